"""processes: the agent and publisher processes of a chaos run (start, kill, stop, stall), and the
small probes the driver runs against them (free ports, RSS, an engine's HTTP JSON).

Every process is started with its own log file and stopped by PID. Not here: what a process does
(publisher.py; the agent is `weightsync agent`), deciding when to kill one (faults.py).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

from bench.chaos.config import ARCH, MODEL, REPO


def free_port() -> int:
    """A free port below the kernel's ephemeral range, for an agent that is killed and restarted
    on it. A port inside that range can be taken, while the agent is down, as the source port of
    any outgoing connection on the machine (a loaded CI machine makes many), and the restart then
    fails with "address in use"; ports below it are only ever taken by an explicit bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    pick = random.SystemRandom()
    for _ in range(1000):
        port = pick.randrange(max(1024, low - 10000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below the ephemeral range (starting at {low}) in 1000 tries")


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def http_json(url: str, body: dict | None = None, timeout_s: float = 5.0) -> dict:
    """One JSON request to an agent's engine; OSError when no whole answer came (an agent killed
    mid-reply cuts it short: IncompleteRead, which is not an OSError by itself)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read())
    except http.client.HTTPException as e:
        raise ConnectionError(f"{url}: {type(e).__name__}: {e}") from e


class AgentProc:
    """One agent process, restartable on the same port and cache."""

    def __init__(self, name: str, region: str, port: int, work: Path, env: dict) -> None:
        self.name, self.region, self.port = name, region, port
        self.address = f"127.0.0.1:{port}"
        self.cache = work / name / "cache"
        self.config_path = work / name / "agent.toml"
        self.log_path = work / name / "agent.log"
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.engine_url: str | None = None
        self.incarnation = 0
        self.stale = False  # this incarnation started from a stale cache copy
        self.stopped = False  # SIGSTOPped
        self.up = threading.Event()

    def write_config(
        self, *, store: str, peers: list[str], token_file: Path, public_key: Path, swap_policy: str = "drain"
    ) -> None:
        engine = {"type": "reference", "port": 0, "torch_threads": 1}
        lines = [
            "[agent]",
            f'model = "{MODEL}"',
            f'name = "{self.name}"',
            f'region = "{self.region}"',
            f'listen = "{self.address}"',
            f'cache_dir = "{self.cache}"',
            f'store = "{store}"',
            f"peers = {json.dumps(peers)}",
            f'token_file = "{token_file}"',
            f'trusted_keys = ["{public_key}"]',
            "require_signatures = true",
            "poll_interval_s = 1.0",
            "push_wait_s = 1.0",
            "workers = 1",
            f'swap_policy = "{swap_policy}"',
            "[agent.engine]",
        ]
        lines += [f"{k} = {json.dumps(v)}" for k, v in engine.items()]
        lines += ["[agent.engine.model]"] + [f"{k} = {json.dumps(v)}" for k, v in ARCH.items()]
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text("\n".join(lines) + "\n")

    def start(self, deadline_s: float) -> None:
        self.cache.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightsync.app.cli", "agent", "--config", str(self.config_path), "-v"],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env,
                cwd=REPO,
            )
        line = readline(self.proc.stdout, deadline_s)
        if line is None:
            self.kill()
            raise TimeoutError(f"agent {self.name} did not print its ready line within {deadline_s} s")
        ready = json.loads(line)
        self.engine_url = ready["engine_url"]
        self.incarnation += 1
        self.stopped = False
        self.up.set()

    def kill(self) -> None:
        self.up.clear()
        if self.proc is not None and self.proc.poll() is None:
            if self.stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.stopped = False

    def terminate(self) -> None:
        self.up.clear()
        if self.proc is not None and self.proc.poll() is None:
            if self.stopped:
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


def readline(stream, timeout_s: float) -> str | None:
    """One line from a child's stdout, or None if none comes in time (the reading thread is left to
    finish when the child dies)."""
    box: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: box.put(stream.readline()), daemon=True).start()
    try:
        line = box.get(timeout=timeout_s)
    except queue.Empty:
        return None
    return line or None


class PublisherProc:
    """The publisher process; events arrive on a queue read by a thread."""

    def __init__(self, spec_path: Path, log_path: Path, env: dict) -> None:
        self.spec_path, self.log_path, self.env = spec_path, log_path, env
        self.proc: subprocess.Popen | None = None
        self.events: queue.Queue = queue.Queue()
        self.incarnation = 0

    def start(self, deadline_s: float) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "bench.chaos", "publisher", "--spec", str(self.spec_path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=self.env,
                cwd=REPO,
            )
        self.events = queue.Queue()
        proc, events = self.proc, self.events

        def read() -> None:
            for line in proc.stdout:
                with contextlib.suppress(ValueError):
                    events.put(json.loads(line))
            events.put({"event": "died", "incarnation": self.incarnation})

        self.incarnation += 1
        threading.Thread(target=read, daemon=True).start()
        event = self.next_event(deadline_s)
        if event is None or event.get("event") != "ready":
            self.kill()
            raise TimeoutError(f"the publisher did not start within {deadline_s} s ({event})")

    def send(self, command: dict) -> None:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def next_event(self, timeout_s: float) -> dict | None:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        if self.alive():
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive() else None
