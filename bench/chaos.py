"""chaos: seeded rounds of faults against a real weightsync cluster, with invariants checked throughout.

    .venv/bin/python -m bench.chaos --rounds 100 --seed 1 [--store local|s3|both]

One machine: a publisher process (it can be SIGKILLed), a store (a local directory, or S3 served by
moto behind tests/fault_proxy.py), and 2 regions x 2 agent processes (`weightsync agent`, each with
the reference inference engine); the publisher pushes to one leader per region, leaders relay to
their follower. Every link between them runs through a TCP proxy of this module that can flip
bytes in flight or black-hole the link (a partition). Manifests are signed and agents require
signatures and a token: the configuration a deployment on a shared network runs.

Each round publishes a few versions while a random mix of faults, drawn from the seed, hits:
SIGKILL of the publisher (mid-encode/upload) or of an agent (mid-stream, mid-relay, mid-swap: at a
random moment of a publish or right after its commit), SIGSTOP of an agent (a hang), a region
leader partitioned away, bytes flipped in flight (on any link) and at rest (a chunk object in the
store, a file in an agent's cache), S3 500s, SlowDowns, resets, truncated bodies, delays and lost
responses, an agent restarted from an older copy of its cache, clock skew in manifests (epoch, years
in the past or future), and garbage collection racing the publisher. Then the faults stop, and
every agent must converge on the store's latest version.

Invariants, checked continuously by a monitor thread and at the end of each round:
  served_digest      what an engine serves (GET /v1/version) is a committed version, with that
                     version's digest; the agent's own re-hash of the served bytes
                     (GetStatus verify) equals it; at each convergence the served model's greedy
                     completion equals the one computed here from the trainer's weights.
  readable           every version in the store verifies (Reader.verify) at the end of each round,
                     and its digest equals that of the trainer's weights for its step.
  monotonic          within an agent process, the served version never goes backwards; a process
                     restarted on its own cache never serves older than before it died. (Restarts
                     from a deliberately stale cache copy serve that older version until they catch
                     up: counted and timed, not a violation; the agent cannot know its disk is old.)
  convergence        once the faults stop and every process is up, all agents serve the latest
                     version within --convergence-bound-s.
  memory             each process's RSS stays within its first served sample + a bound.
  no_hang            every publish finishes or fails within its deadline; every process starts.
Corrupting a *committed* object at rest makes that version unreadable by design (there is no second
copy): the invariant there is detection, not survival. Every version naming the object must fail
to verify (never return other bytes), agents must keep serving verified bytes, and once the object is
restored (what re-replication or a backup does) everything converges; it is restored before the
end-of-round checks.

Prints one JSON summary (config, machine, rounds, faults by kind, violations with details, convergence
p50/p90/max, peak RSS per kind of process) and exits 1 on any violation. tests/test_chaos.py runs a
few rounds in CI. Not here: throughput or latency numbers (bench/transport.py, bench/sync_latency.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import logging
import os
import platform
import queue
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
import uuid
from pathlib import Path

from bench.moto import MotoServer

MODEL = "chaos-lm"
ARCH = {"vocab_size": 259, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}
REGIONS = ("east", "west")
PROMPT = "weightsync chaos: "
REPO = Path(__file__).resolve().parent.parent
FAULT_KINDS = ("kill_publisher", "kill_agent", "stall_agent", "partition_leader", "flip_in_flight",
               "flip_store_object", "flip_agent_cache", "stale_cache_restart", "s3_faults", "clock_skew",
               "gc_during_publish")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    rounds: int = 10
    seed: int = 0
    store: str = "local"
    """"local" (a directory) or "s3" (moto behind tests/fault_proxy.py)."""
    versions_per_round: int = 3
    convergence_bound_s: float = 60.0
    publish_deadline_s: float = 180.0
    """A publish (one attempt) that neither commits nor fails within this long is a hang."""
    start_deadline_s: float = 180.0
    chunk_bytes: int = 4096
    rebase_every: int = 3
    slow_s: float = 0.015
    """Pause per encoded object in the publisher, so that kills land mid-upload, not after it."""
    gc_keep: int = 3
    gc_grace_s: float = 60.0
    rss_growth_bound_mb: float = 160.0
    """Allowed RSS growth of a process over its first sample once it serves (leaks, chain blow-ups)."""
    fault_scale: float = 1.0
    """Multiplies every fault's per-round probability (capped at 1)."""
    workdir: str | None = None
    keep_workdir: bool = False

    def __post_init__(self) -> None:
        if self.store not in ("local", "s3"):
            raise ValueError(f"store must be local or s3, got {self.store!r}")
        if self.rounds < 1 or self.versions_per_round < 1:
            raise ValueError("rounds and versions_per_round must be >= 1")


FAULT_PROBABILITY = {
    "kill_publisher": 0.3, "kill_agent": 0.45, "stall_agent": 0.2, "partition_leader": 0.25, "flip_in_flight": 0.35,
    "flip_store_object": 0.25, "flip_agent_cache": 0.3, "stale_cache_restart": 0.2, "s3_faults": 0.7,
    "clock_skew": 0.4, "gc_during_publish": 0.3,
}


# ------------------------------------------------------------------------------ the trainer


class Trainer:
    """Stands in for the trainer: fp32 master weights; each step nudges ~5 % of them, so bf16
    versions differ sparsely. Deterministic in (seed, step), so a restarted publisher and the
    checker rebuild the same weights."""

    def __init__(self, seed: int) -> None:
        import torch

        from weightsync.models import ModelConfig, build_model

        self._torch = torch
        self.seed = seed
        self.model = build_model(ModelConfig(**ARCH), seed=seed)
        self.step = 0

    def advance_to(self, step: int) -> None:
        torch = self._torch
        if step < self.step:
            raise ValueError(f"the trainer is at step {self.step}; it cannot go back to {step}")
        with torch.no_grad():
            while self.step < step:
                self.step += 1
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
                for p in self.model.parameters():
                    mask = torch.rand(p.shape, generator=g) < 0.05
                    p.add_(mask * torch.randn(p.shape, generator=g) * 1e-2 * p.abs().mean())

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def published(self) -> dict:
        torch = self._torch
        return {n: t.detach().to(torch.bfloat16) for n, t in self.model.state_dict().items()}


def expected_digest(weights: dict, chunk_bytes: int) -> str:
    """The version digest a publisher with `chunk_bytes` writes for these bf16 weights."""
    from weightsync.hashing import xxh3_hex
    from weightsync.manifest import ChunkRef, TensorEntry, compute_digest
    from weightsync.tensors import dtype_of, raw_bytes

    entries = []
    for name in sorted(weights):
        tensor = weights[name].contiguous()
        dtype = dtype_of(tensor)
        data = raw_bytes(tensor)
        per_chunk = max(1, chunk_bytes // dtype.itemsize)
        count = tensor.numel()
        chunks = tuple(ChunkRef(start=s, stop=min(s + per_chunk, count), codec="same",
                                raw=xxh3_hex(data[s * dtype.itemsize:min(s + per_chunk, count) * dtype.itemsize]))
                       for s in range(0, count, per_chunk))
        entries.append(TensorEntry(name=name, dtype=dtype.name, shape=tuple(tensor.shape), chunks=chunks))
    return compute_digest(entries)


# ------------------------------------------------------------------------------ the publisher process


class _SkewedClock:
    """The `time` module as the publisher sees it, with time() shifted: clock skew in manifests."""

    def __init__(self, skew_s: float) -> None:
        self.skew_s = skew_s

    def time(self) -> float:
        return time.time() + self.skew_s

    def __getattr__(self, name: str):
        return getattr(time, name)


def publisher_main(spec_path: str) -> int:
    """The publisher process: reads {"step", "slow_s", "skew_s"} lines on stdin, publishes the
    trainer's weights of that step, answers one JSON event per line on stdout."""
    import weightsync.publisher as publisher_module
    from weightsync.publisher import Publisher, PublisherConfig
    from weightsync.push import PushConfig, Pusher
    from weightsync.signing import Signer
    from weightsync.store import open_store

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    slow = {"s": 0.0}

    class SlowLink:
        """A slow encoder/uplink: each object costs `slow_s`, so a kill lands mid-upload."""

        def on_object(self, version, object_xxh3, obj):
            if slow["s"]:
                time.sleep(slow["s"])

        def on_commit(self, manifest, manifest_bytes, signature):
            pass

        def on_failure(self, version, error):
            pass

    pusher = Pusher(PushConfig(targets=tuple(spec["targets"]), model=MODEL, token=spec["token"],
                               give_up_after_s=spec["push_give_up_s"], retry_backoff_s=(0.1, 2.0)))
    config = PublisherConfig(chunk_bytes=spec["chunk_bytes"], rebase_every=spec["rebase_every"], workers=1,
                             max_in_flight=1)
    publisher = Publisher(open_store(spec["store"]), model=MODEL, config=config,
                          signer=Signer.from_pem(spec["signing_key"]), listeners=[SlowLink(), pusher])
    trainer = Trainer(spec["seed"])
    print(json.dumps({"event": "ready", "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        step = command["step"]
        slow["s"] = command.get("slow_s", 0.0)
        publisher_module.time = _SkewedClock(command.get("skew_s", 0.0))
        try:
            trainer.advance_to(step)
            result = publisher.publish(trainer.state_dict(), step=step).result()
            event = {"event": "committed", "step": step, "version": result.version, "digest": result.manifest.digest,
                     "kind": result.manifest.kind, "created_unix_ms": result.manifest.created_unix_ms}
        except Exception as e:  # noqa: BLE001 - the driver decides what a failure means; the process stays up
            event = {"event": "failed", "step": step, "error": f"{type(e).__name__}: {e}"}
        finally:
            publisher_module.time = time
        print(json.dumps(event), flush=True)
    publisher.close()
    pusher.close(timeout_s=5)
    return 0


# ------------------------------------------------------------------------------ links


class TcpProxy:
    """A TCP relay for one link: forwards bytes both ways, flips bytes at `flip_rate` per read, or
    holds everything while `partitioned` (packets dropped, connections hang: what a partition looks
    like to both ends until keepalives give up). On healing, held data flows again."""

    def __init__(self, name: str, target_port: int, rng: random.Random) -> None:
        self.name = name
        self.target = ("127.0.0.1", target_port)
        self.partitioned = False
        self.flip_rate = 0.0
        self.flips = 0
        self._rng = rng
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._sockets: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name=f"proxy-{name}", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:  # the agent is down: the caller sees a reset, as from a dead host
                client.close()
                continue
            with self._lock:
                self._sockets.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                while self.partitioned and not self._closed:
                    time.sleep(0.05)
                if self.flip_rate and self._rng.random() < self.flip_rate:
                    buf = bytearray(data)
                    i = self._rng.randrange(len(buf))
                    buf[i] ^= 1 << self._rng.randrange(8)
                    data = bytes(buf)
                    with self._lock:
                        self.flips += 1
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            s.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        return None
    return None


def _http_json(url: str, body: dict | None = None, timeout_s: float = 5.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


# ------------------------------------------------------------------------------ processes


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

    def write_config(self, *, store: str, peers: list[str], token_file: Path, public_key: Path) -> None:
        engine = {"type": "reference", "port": 0, "torch_threads": 1}
        lines = ["[agent]", f'model = "{MODEL}"', f'name = "{self.name}"', f'region = "{self.region}"',
                 f'listen = "{self.address}"', f'cache_dir = "{self.cache}"', f'store = "{store}"',
                 f"peers = {json.dumps(peers)}", f'token_file = "{token_file}"',
                 f'trusted_keys = ["{public_key}"]', "require_signatures = true", "poll_interval_s = 1.0",
                 "push_wait_s = 1.0", "workers = 1", "[agent.engine]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in engine.items()]
        lines += ["[agent.engine.model]"] + [f"{k} = {json.dumps(v)}" for k, v in ARCH.items()]
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text("\n".join(lines) + "\n")

    def start(self, deadline_s: float) -> None:
        self.cache.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "weightsync.app.cli", "agent", "--config", str(self.config_path), "-v"],
                stdout=subprocess.PIPE, stderr=log, text=True, env=self.env, cwd=REPO)
        line = _readline(self.proc.stdout, deadline_s)
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


def _readline(stream, timeout_s: float) -> str | None:
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
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=self.env, cwd=REPO)
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


# ------------------------------------------------------------------------------ the monitor


class Monitor:
    """Watches every agent while faults happen: what it serves (engine /v1/version), whether the
    served bytes re-hash to the version's digest (GetStatus verify), and process RSS."""

    def __init__(self, run: Run, interval_s: float = 0.3, verify_every_s: float = 1.5) -> None:
        self.run = run
        self.interval_s = interval_s
        self.verify_every_s = verify_every_s
        self.observations = 0
        self.verify_calls = 0
        self.verify_races = 0
        self.last: dict[str, tuple[int, int]] = {}  # agent -> (incarnation, version) last seen
        self.max_seen: dict[str, int] = collections.defaultdict(int)  # agent -> highest version, this incarnation
        self.before_restart: dict[str, int] = {}  # agent -> highest version of the previous incarnation
        self.stale_windows: list[float] = []
        self._stale_since: dict[str, float] = {}
        self._unknown_since: dict[tuple[str, int], float] = {}
        self._next_verify: dict[str, float] = collections.defaultdict(float)
        self.rss_first: dict[tuple[str, str, int], float] = {}
        self.rss_peak: dict[str, float] = collections.defaultdict(float)
        self.rss_growth: dict[str, float] = collections.defaultdict(float)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-monitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def agent_killed(self, agent: AgentProc) -> None:
        self.before_restart[agent.name] = max(self.before_restart.get(agent.name, 0), self.max_seen[agent.name])

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            for agent in list(self.run.agents.values()):
                if agent.up.is_set() and not agent.stopped:
                    try:
                        self._observe(agent)
                    except Exception as e:  # noqa: BLE001 - a checker bug must be reported, not end the monitor
                        self.run.violation("monitor", agent.name, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            self._sample_rss()

    def _observe(self, agent: AgentProc) -> None:
        incarnation, url = agent.incarnation, agent.engine_url
        try:
            info = _http_json(url + "/v1/version", timeout_s=2.0)
        except OSError:
            return  # killed, stopped or restarting: nothing is served by this process now
        version, digest = info.get("weight_version"), info.get("weight_digest")
        if version is None or incarnation != agent.incarnation:
            return
        self.observations += 1
        name = agent.name
        committed = self.run.committed_digest(version)
        if committed is None:  # not (yet) seen in the store: allowed only for the instant of a commit race
            first = self._unknown_since.setdefault((name, version), time.monotonic())
            if time.monotonic() - first > 15:
                self.run.violation("served_digest", name, f"serves v{version}, which the store never committed")
        elif committed != digest:
            self.run.violation("served_digest", name, f"serves v{version} with digest {digest}, committed {committed}")
        seen_incarnation, seen_version = self.last.get(name, (0, 0))
        if seen_incarnation == incarnation and version < seen_version:
            self.run.violation("monotonic", name, f"went back from v{seen_version} to v{version} in one process")
        if seen_incarnation != incarnation:  # the first version a restarted process serves
            self.max_seen[name] = 0
            before = self.before_restart.get(name, 0)
            if version < before:
                if agent.stale:
                    self._stale_since.setdefault(name, time.monotonic())
                else:
                    self.run.violation("monotonic", name, f"restarted on its own cache serving v{version}, "
                                                          f"older than the v{before} it served before it died")
            else:
                agent.stale = False  # caught up before we looked: its cache is its own from here
        if name in self._stale_since and version >= self.before_restart.get(name, 0):
            self.stale_windows.append(time.monotonic() - self._stale_since.pop(name))
            agent.stale = False
        self.last[name] = (incarnation, version)
        self.max_seen[name] = max(self.max_seen[name], version)
        if time.monotonic() >= self._next_verify[name]:
            self._next_verify[name] = time.monotonic() + self.verify_every_s
            self.verify(agent)

    def verify(self, agent: AgentProc, *, final: bool = False) -> bool:
        """The agent re-hashes what it serves; a mismatch that persists on one version is a violation
        (one that goes away as the version changes is the re-hash racing a swap)."""
        from weightsync.errors import WeightsyncError

        mismatches = []
        for attempt in range(4):
            try:
                reply = self.run.client(agent).status(timeout_s=5, verify=True)
            except WeightsyncError:
                return False
            self.verify_calls += 1
            if not reply.served_digest:
                return False
            committed = self.run.committed_digest(reply.current_version)
            ok = reply.served_digest == reply.current_digest and committed in (None, reply.current_digest)
            if ok:
                if attempt:
                    self.verify_races += 1
                return True
            mismatches.append((reply.current_version, reply.current_digest, reply.served_digest, committed))
            if len({m[0] for m in mismatches}) > 1:  # the version changed under the re-hash: retry
                mismatches = mismatches[-1:]
            time.sleep(0.2)
        self.run.violation("served_digest", agent.name, f"served bytes do not hash to the version digest "
                                                        f"(version, digest, re-hash, committed): {mismatches}")
        return False

    def _sample_rss(self) -> None:
        processes = [("agent", a.name, a.incarnation, a.pid) for a in self.run.agents.values()]
        publisher = self.run.publisher
        processes.append(("publisher", "publisher", publisher.incarnation, publisher.pid))
        processes.append(("driver", "driver", 0, os.getpid()))
        for kind, name, incarnation, pid in processes:
            if pid is None:
                continue
            rss = _rss_mb(pid)
            if rss is None:
                continue
            self.rss_peak[kind] = max(self.rss_peak[kind], rss)
            # The baseline is taken once the process has done its first piece of work: an agent
            # served a version, the publisher committed one (before that it is still importing).
            if kind == "agent":
                serving = self.last.get(name, (0, 0))[0] == incarnation
            elif kind == "publisher":
                serving = self.run.publisher_worked == incarnation
            else:
                serving = True
            if not serving:
                continue
            key = (kind, name, incarnation)
            first = self.rss_first.setdefault(key, rss)
            self.rss_growth[kind] = max(self.rss_growth[kind], rss - first)
            if kind != "driver" and rss - first > self.run.config.rss_growth_bound_mb:
                self.run.violation("memory", name, f"RSS grew from {first:.0f} to {rss:.0f} MB (bound "
                                                   f"+{self.run.config.rss_growth_bound_mb:.0f} MB)")
                self.rss_first[key] = rss  # report each excursion once


# ------------------------------------------------------------------------------ the run


class Run:
    """One cluster and its rounds."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.work = Path(config.workdir or tempfile.mkdtemp(prefix=f"chaos-{config.store}-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.round = 0
        self.step = 0
        self.faults: collections.Counter[str] = collections.Counter()
        self.details: collections.Counter[str] = collections.Counter()
        self.violations: list[dict] = []
        self.convergence_s: list[float] = []
        self.expected: dict[int, str] = {}  # trainer step -> digest of its bf16 weights
        self._committed: dict[int, str] = {}
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._corrupted: list[tuple[str, bytes]] = []
        self._publishing = False
        self.publisher_worked = 0  # the publisher incarnation that committed last
        self.snapshots: dict[str, Path] = {}
        self.agents: dict[str, AgentProc] = {}
        self._clients: dict[tuple[str, int], object] = {}
        self.monitor: Monitor | None = None
        self.moto: MotoServer | None = None
        self.s3_proxy = None
        self.proxies: dict[str, TcpProxy] = {}
        self.checks: collections.Counter[str] = collections.Counter()

    # ---------------------------------------------------------------- setup and teardown

    def setup(self) -> None:
        from weightsync.signing import Signer
        from weightsync.store import LocalStore

        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if self.config.store == "s3":
            self.store_uri, self.direct = self._setup_s3(env)
        else:
            self.store_uri = f"file://{self.work / 'store'}"
            self.direct = LocalStore(self.work / "store")
        signer = Signer.generate()
        signer.write(self.work / "publisher.key", self.work / "publisher.pub")
        self.token = uuid.uuid4().hex
        (self.work / "token").write_text(self.token + "\n")
        ports = {f"{r}-{i}": _free_port() for r in REGIONS for i in (1, 2)}
        for region in REGIONS:
            leader, follower = f"{region}-1", f"{region}-2"
            self.proxies[f"publisher->{leader}"] = TcpProxy(f"publisher->{leader}", ports[leader],
                                                            random.Random(self.rng.random()))
            self.proxies[f"{leader}->{follower}"] = TcpProxy(f"{leader}->{follower}", ports[follower],
                                                             random.Random(self.rng.random()))
            for name in (leader, follower):
                agent = AgentProc(name, region, ports[name], self.work, env)
                peers = [self.proxies[f"{leader}->{follower}"].address] if name == leader else []
                agent.write_config(store=self.store_uri, peers=peers, token_file=self.work / "token",
                                   public_key=self.work / "publisher.pub")
                self.agents[name] = agent
        spec = {"store": self.store_uri, "seed": self.config.seed, "chunk_bytes": self.config.chunk_bytes,
                "rebase_every": self.config.rebase_every, "token": self.token, "push_give_up_s": 30.0,
                "signing_key": str(self.work / "publisher.key"),
                "targets": [self.proxies[f"publisher->{r}-1"].address for r in REGIONS]}
        (self.work / "publisher.json").write_text(json.dumps(spec))
        self.publisher = PublisherProc(self.work / "publisher.json", self.work / "publisher.log", env)
        self.trainer = Trainer(self.config.seed)
        starters = [threading.Thread(target=a.start, args=(self.config.start_deadline_s,)) for a in self.agents.values()]
        starters.append(threading.Thread(target=self.publisher.start, args=(self.config.start_deadline_s,)))
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        if not self.publisher.alive() or not all(a.up.is_set() for a in self.agents.values()):
            raise RuntimeError(f"the cluster did not start; logs in {self.work}")
        from weightsync.agents.reference_server import ReferenceServer, ReferenceServerConfig

        self.reference = ReferenceServer(ReferenceServerConfig(model=ARCH, torch_threads=1))
        self.monitor = Monitor(self)
        self.monitor.start()

    def _setup_s3(self, env: dict):
        import boto3

        from weightsync.s3_store import S3Store

        sys.path.insert(0, str(REPO / "tests"))
        from fault_proxy import FaultProxy

        creds = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
        os.environ.update(creds)
        for name in [k for k in os.environ if k.startswith("AWS_") and k not in creds]:
            del os.environ[name]
        self.moto = MotoServer().start()
        endpoint = self.moto.endpoint
        bucket = f"chaos-{uuid.uuid4().hex[:10]}"
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        self.s3_proxy = FaultProxy(endpoint)
        self.s3_proxy.start()
        self.s3_proxy.enabled = False
        env.update(creds, AWS_ENDPOINT_URL=self.s3_proxy.endpoint)
        return f"s3://{bucket}/chaos", S3Store(bucket, "chaos", endpoint_url=endpoint)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        for t in self._threads:
            t.join(timeout=60)
        self.publisher.close()
        for agent in self.agents.values():
            agent.terminate()
        for proxy in self.proxies.values():
            proxy.close()
        if self.s3_proxy is not None:
            self.s3_proxy.stop()
        if self.moto is not None:
            self.moto.stop()
        for client in self._clients.values():
            client.close()
        if not self.config.keep_workdir and not self.violations:
            shutil.rmtree(self.work, ignore_errors=True)

    # ---------------------------------------------------------------- shared state

    def violation(self, invariant: str, who: str, detail: str) -> None:
        with self._lock:
            self.violations.append({"round": self.round, "invariant": invariant, "who": who, "detail": detail})
        print(f"chaos: VIOLATION round {self.round} {invariant} {who}: {detail}", file=sys.stderr, flush=True)

    def committed_digest(self, version: int) -> str | None:
        with self._lock:
            digest = self._committed.get(version)
        if digest is None:
            self.refresh_committed()
            with self._lock:
                digest = self._committed.get(version)
        return digest

    def refresh_committed(self) -> list[int]:
        from weightsync.errors import WeightsyncError
        from weightsync.versions import list_versions, read_manifest

        versions = list_versions(self.direct, MODEL)
        for v in versions:
            with self._lock:
                if v in self._committed:
                    continue
            try:
                manifest = read_manifest(self.direct, MODEL, v)
            except WeightsyncError:
                continue  # deleted by gc meanwhile
            with self._lock:
                self._committed[v] = manifest.digest
        return versions

    def client(self, agent: AgentProc):
        from weightsync.rpc import AgentClient

        key = (agent.name, agent.incarnation)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = AgentClient(agent.address, token=self.token)
        return client

    def _background(self, target, *args) -> None:
        t = threading.Thread(target=self._guarded, args=(target, *args), daemon=True)
        self._threads.append(t)
        t.start()

    def _guarded(self, target, *args) -> None:
        try:
            target(*args)
        except Exception as e:  # noqa: BLE001 - a fault action that fails is a finding, reported as one
            self.violation("no_hang", getattr(target, "__name__", "?"), f"{type(e).__name__}: {e}")

    # ---------------------------------------------------------------- rounds

    def warm_up(self) -> None:
        """Round 0: one version without faults, served everywhere: the state every round starts from."""
        self._publish(plan={})
        self._converge(record=False)

    def run_round(self, number: int) -> None:
        self.round = number
        plan = self._draw_plan()
        for kind, on in plan.items():
            self.faults[kind] += bool(on)
        print(f"chaos: round {number} {self.config.store}: {sorted(k for k, on in plan.items() if on)}",
              file=sys.stderr, flush=True)
        if plan.get("s3_faults"):
            self._start_s3_faults()
        if plan.get("partition_leader"):
            leader = f"{self.rng.choice(REGIONS)}-1"
            for name, proxy in self.proxies.items():
                if leader in name:
                    proxy.partitioned = True
        if plan.get("flip_in_flight"):
            for proxy in self.rng.sample(sorted(self.proxies.values(), key=lambda p: p.name), self.rng.randint(1, 2)):
                proxy.flip_rate = self.rng.uniform(0.02, 0.12)
        if plan.get("stale_cache_restart"):
            self._stale_restart()
        n = self.config.versions_per_round
        at = {kind: self.rng.randrange(n) for kind in plan if plan[kind]}
        for i in range(n):
            self._publish(plan={k: on and at[k] == i for k, on in plan.items()})
            if plan.get("flip_store_object") and at["flip_store_object"] == i:
                self._flip_store_object()
            if plan.get("flip_agent_cache") and at["flip_agent_cache"] == i:
                self._flip_agent_cache()
        self._heal()
        self._converge(record=True)
        self._check_round()

    def _draw_plan(self) -> dict[str, bool]:
        kinds = [k for k in FAULT_KINDS if (k != "s3_faults" or self.config.store == "s3")
                 and (k != "stale_cache_restart" or self.snapshots)]
        plan = {k: self.rng.random() < min(1.0, FAULT_PROBABILITY[k] * self.config.fault_scale) for k in kinds}
        if not any(plan.values()):
            plan[self.rng.choice(kinds)] = True
        return plan

    def _publish(self, plan: dict[str, bool]) -> None:
        """One trainer step, published; retried (after restarting a killed publisher) until committed."""
        step = self.step + 1
        self.trainer.advance_to(step)
        self.expected[step] = expected_digest(self.trainer.published(), self.config.chunk_bytes)
        skew_s = 0.0
        if plan.get("clock_skew"):
            skew_s = self.rng.choice([-time.time() + self.rng.uniform(0, 86400),  # near the epoch
                                      -self.rng.uniform(1, 20) * 365 * 86400,  # years in the past
                                      self.rng.uniform(1, 80) * 365 * 86400])  # years in the future
            self.details["clock_skew_publishes"] += 1
        estimate_s = 70 * self.config.slow_s + 0.3
        for attempt in range(6):
            if not self.publisher.alive():
                self.publisher.start(self.config.start_deadline_s)
                self.details["publisher_restarts"] += 1
            timers = []
            if attempt == 0:
                for kind, action in (("kill_publisher", self._kill_publisher), ("kill_agent", self._kill_agent),
                                     ("stall_agent", self._stall_agent), ("gc_during_publish", self._gc)):
                    if plan.get(kind):
                        # Each action gets its own generator, drawn here: the plan stays a function
                        # of the seed although actions run on timer threads.
                        timers.append(threading.Timer(self.rng.uniform(0, 1.5 * estimate_s), self._guarded,
                                                      args=(action, random.Random(self.rng.getrandbits(64)))))
            self._publishing = True
            self.details["publish_attempts"] += 1
            self.publisher.send({"step": step, "slow_s": self.config.slow_s, "skew_s": skew_s})
            for t in timers:
                t.start()
            event = self.publisher.next_event(self.config.publish_deadline_s)
            self._publishing = False
            for t in timers:
                t.join()
            if event is None:
                self.violation("no_hang", "publisher", f"step {step}: no outcome within {self.config.publish_deadline_s} s")
                self.publisher.kill()
            elif event["event"] == "committed":
                with self._lock:
                    self._committed[event["version"]] = event["digest"]
                self.details["versions_committed"] += 1
                self.publisher_worked = self.publisher.incarnation
                self.step = step  # a publisher killed right after this commit is restarted by the next publish
                return
            elif event["event"] == "failed":
                self.details["publish_failures"] += 1
                print(f"chaos: publish of step {step} failed: {event['error']}", file=sys.stderr, flush=True)
            # "died": the publisher was killed mid-publish; the loop restarts it and publishes the step again
        self.violation("no_hang", "publisher", f"step {step} never committed in 6 attempts")
        self.step = step

    # ---------------------------------------------------------------- faults

    def _kill_publisher(self, rng: random.Random) -> None:
        self.details["kill_publisher_" + ("mid_publish" if self._publishing else "idle")] += 1
        self.publisher.kill()

    def _pick_agent(self, rng: random.Random) -> AgentProc | None:
        candidates = [a for a in self.agents.values() if a.up.is_set() and not a.stopped]
        return rng.choice(sorted(candidates, key=lambda a: a.name)) if candidates else None

    def _kill_agent(self, rng: random.Random) -> None:
        agent = self._pick_agent(rng)
        if agent is None:
            return
        with self._lock:
            latest = max(self._committed, default=0)
        behind = self.monitor.last.get(agent.name, (0, 0))[1] < latest
        phase = "during_publish" if self._publishing else ("mid_sync" if behind else "idle")
        self.details[f"kill_agent_{phase}"] += 1
        self.monitor.agent_killed(agent)
        agent.kill()
        # agent.stale stays as it is: a cache copied in stale is the agent's own only once the
        # monitor has seen it serve what it served before (round 84 of a 100-round S3 run killed
        # an agent right after its stale restart, and its restart served the stale version).
        self._background(self._restart_later, agent, rng.uniform(0.2, 3.0))

    def _restart_later(self, agent: AgentProc, delay_s: float) -> None:
        time.sleep(delay_s)
        agent.start(self.config.start_deadline_s)

    def _stall_agent(self, rng: random.Random) -> None:
        agent = self._pick_agent(rng)
        if agent is None:
            return
        agent.stopped = True
        os.kill(agent.proc.pid, signal.SIGSTOP)

        def resume(seconds: float) -> None:
            time.sleep(seconds)
            if agent.stopped and agent.proc.poll() is None:
                os.kill(agent.proc.pid, signal.SIGCONT)
            agent.stopped = False

        self._background(resume, rng.uniform(1.0, 6.0))

    def _gc(self, rng: random.Random) -> None:
        from weightsync.errors import WeightsyncError
        from weightsync.retention import collect_garbage

        try:
            plan = collect_garbage(self.direct, MODEL, keep=self.config.gc_keep, grace_s=self.config.gc_grace_s)
            self.details["gc_versions_deleted"] += len(plan.delete_versions)
        except WeightsyncError as e:
            self.details["gc_errors"] += 1
            print(f"chaos: gc failed: {e}", file=sys.stderr, flush=True)

    def _start_s3_faults(self) -> None:
        from fault_proxy import DELAY, FaultPlan
        from fault_proxy import FAULT_KINDS as S3_KINDS

        total = self.rng.uniform(0.05, 0.25)
        kinds = self.rng.sample(list(S3_KINDS), self.rng.randint(2, len(S3_KINDS)))
        weights = [self.rng.random() for _ in kinds]
        rates = {k: total * w / sum(weights) for k, w in zip(kinds, weights)}
        self.s3_proxy.set_plan(FaultPlan(rates=rates, seed=self.rng.randrange(2**31), delay_s=0.3))
        self.s3_proxy.enabled = True
        if DELAY in rates:
            self.details["s3_delay_rounds"] += 1

    def _stale_restart(self) -> None:
        name = self.rng.choice(sorted(self.snapshots))
        agent = self.agents[name]
        if not agent.up.is_set():
            return
        self.monitor.agent_killed(agent)
        agent.kill()
        shutil.rmtree(agent.cache, ignore_errors=True)
        shutil.copytree(self.snapshots[name], agent.cache)
        agent.stale = True
        self.details["stale_cache_restarts"] += 1
        self._background(self._restart_later, agent, 0.0)

    def _flip_store_object(self) -> None:
        from weightsync.errors import IntegrityError, WeightsyncError
        from weightsync.layout import model_prefix
        from weightsync.reader import Reader
        from weightsync.versions import latest_version, read_manifest

        version = latest_version(self.direct, MODEL)
        manifest = read_manifest(self.direct, MODEL, version)
        refs = [c for t in manifest.tensors for c in t.chunks if c.key]
        if not refs:
            return
        ref = self.rng.choice(refs)
        key = model_prefix(MODEL) + ref.key
        original = self.direct.get(key)
        corrupt = bytearray(original)
        corrupt[self.rng.randrange(len(corrupt))] ^= 1 << self.rng.randrange(8)
        self.direct.put(key, bytes(corrupt))
        self._corrupted.append((key, original))
        try:
            Reader(self.direct, model=MODEL, workers=1).verify(version)
        except IntegrityError:
            self.checks["store_corruptions_detected"] += 1
        except WeightsyncError as e:
            self.violation("readable", "store", f"corrupt {key} of v{version} refused with {type(e).__name__}, "
                                                f"not IntegrityError: {e}")
        else:
            self.violation("readable", "store", f"v{version} verified with a flipped byte in {key}")

    def _flip_agent_cache(self) -> None:
        agent = self._pick_agent(self.rng)
        if agent is None:
            return
        files = [p for p in agent.cache.rglob("*") if p.is_file() and not p.name.startswith(".tmp")]
        chunks = [p for p in files if "chunks" in p.parts]
        manifests = [p for p in files if "versions" in p.parts]
        state = [p for p in files if p.name == "agent-state.json"]
        pool = self.rng.choices([chunks, manifests, state], weights=[0.7, 0.2, 0.1])[0] or chunks
        if not pool:
            return
        path = self.rng.choice(sorted(pool))
        try:
            with open(path, "r+b") as f:  # in place, as bit rot would
                size = f.seek(0, os.SEEK_END)
                if size == 0:
                    return
                at = self.rng.randrange(size)
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ (1 << self.rng.randrange(8))]))
        except FileNotFoundError:
            return  # collected by the agent meanwhile
        kind = "chunk" if path in chunks else "manifest" if path in manifests else "state"
        self.details[f"flip_agent_cache_{kind}"] += 1

    def _heal(self) -> None:
        """The faults stop: links heal, the S3 proxy passes through, stalled agents resume, corrupt
        store objects are restored, every killed process is back up."""
        if self.s3_proxy is not None:
            self.s3_proxy.enabled = False
        for proxy in self.proxies.values():
            proxy.partitioned = False
            proxy.flip_rate = 0.0
        for t in self._threads:
            t.join(timeout=self.config.start_deadline_s)
        self._threads = [t for t in self._threads if t.is_alive()]
        for key, original in self._corrupted:
            self.direct.put(key, original)
        self._corrupted.clear()
        for agent in self.agents.values():
            if not agent.up.is_set():
                self.violation("no_hang", agent.name, "still down after the faults stopped")
                agent.kill()
                agent.start(self.config.start_deadline_s)

    def _converge(self, *, record: bool) -> None:
        latest = max(self.refresh_committed(), default=0)
        digest = self.committed_digest(latest)
        t0 = time.monotonic()
        deadline = t0 + self.config.convergence_bound_s
        pending = set(self.agents)
        while pending and time.monotonic() < deadline:
            for name in sorted(pending):
                with contextlib.suppress(OSError, ValueError):
                    info = _http_json(self.agents[name].engine_url + "/v1/version", timeout_s=2.0)
                    if info["weight_version"] == latest and info["weight_digest"] == digest:
                        pending.discard(name)
            if pending:
                time.sleep(0.1)
        elapsed = time.monotonic() - t0
        if pending:
            errors = {}
            for name in pending:
                with contextlib.suppress(Exception):
                    errors[name] = self.client(self.agents[name]).status(timeout_s=5).last_error
            self.violation("convergence", ",".join(sorted(pending)),
                           f"not serving v{latest} {self.config.convergence_bound_s} s after the faults stopped; "
                           f"last errors: {errors}")
        elif record:
            self.convergence_s.append(elapsed)

    def _check_round(self) -> None:
        from weightsync.errors import WeightsyncError
        from weightsync.reader import Reader
        from weightsync.retention import collect_garbage

        reader = Reader(self.direct, model=MODEL, workers=1)
        versions = self.refresh_committed()
        for version in versions:
            try:
                manifest = reader.verify(version)
            except WeightsyncError as e:
                if version in self.refresh_committed():  # not deleted by gc while we read it
                    self.violation("readable", "store", f"v{version}: {type(e).__name__}: {e}")
                continue
            self.checks["versions_verified"] += 1
            if self.expected.get(manifest.step) not in (None, manifest.digest):
                self.violation("readable", "store", f"v{version} (step {manifest.step}) has digest {manifest.digest}, "
                                                    f"the trainer's weights {self.expected[manifest.step]}")
        for agent in self.agents.values():
            self.monitor.verify(agent, final=True)
        # What each agent's model answers, against the same engine code run here on the store's bytes
        # of the version it serves (whether it serves the latest is the convergence check's business).
        body = {"prompts": [PROMPT], "max_new_tokens": 8, "temperature": 0}
        expected: dict[int, list[int]] = {}
        for agent in self.agents.values():
            try:
                got = _http_json(agent.engine_url + "/v1/generate", body, timeout_s=30)
            except OSError as e:
                self.violation("served_digest", agent.name, f"generate failed after convergence: {e}")
                continue
            version = got["weight_version"]
            if version not in expected:
                try:
                    state = reader.read(version)
                except WeightsyncError:
                    continue  # collected meanwhile: served_digest has checked it against its digest already
                self.reference.swap(version, state.state_dict(), digest=state.manifest.digest)
                expected[version] = self.reference.handle_generate(json.dumps(body).encode())["completions"][0][
                    "token_ids"]
            self.checks["generation_checks"] += 1
            if got["completions"][0]["token_ids"] != expected[version]:
                self.violation("served_digest", agent.name, f"greedy completion {got['completions'][0]['token_ids']} "
                                                            f"on v{version}; its published weights give "
                                                            f"{expected[version]}")
        try:
            collect_garbage(self.direct, MODEL, keep=self.config.gc_keep + 1, grace_s=self.config.gc_grace_s)
        except WeightsyncError as e:
            print(f"chaos: gc failed: {e}", file=sys.stderr, flush=True)
        if self.rng.random() < 0.35:  # a copy of some agent's cache, for a later stale-cache restart
            agent = self._pick_agent(self.rng)
            if agent is not None:
                target = self.work / "snapshots" / agent.name
                shutil.rmtree(target, ignore_errors=True)
                with contextlib.suppress(OSError, shutil.Error):  # files the agent deletes while we copy
                    shutil.copytree(agent.cache, target)
                    self.snapshots[agent.name] = target

    # ---------------------------------------------------------------- summary

    def summary(self, wall_s: float) -> dict:
        times = sorted(self.convergence_s)
        monitor = self.monitor
        s3 = self.s3_proxy.counts() if self.s3_proxy is not None else {}
        return {
            "store": self.config.store,
            "rounds": self.round,
            "versions_committed": self.details["versions_committed"],
            "faults": {k: self.faults[k] for k in FAULT_KINDS if k in self.faults},
            "fault_details": dict(sorted(self.details.items())) | {
                "flips_in_flight": sum(p.flips for p in self.proxies.values()),
                "s3_injected": s3, "stale_windows_max_s": round(max(monitor.stale_windows, default=0.0), 2)},
            "violations": len(self.violations),
            "violation_details": self.violations[:50],
            "convergence_s": {"p50": round(statistics.median(times), 2) if times else None,
                              "p90": round(times[int(0.9 * (len(times) - 1))], 2) if times else None,
                              "max": round(times[-1], 2) if times else None,
                              "bound": self.config.convergence_bound_s},
            "peak_rss_mb": {k: round(v, 1) for k, v in sorted(monitor.rss_peak.items())},
            "max_rss_growth_mb": {k: round(v, 1) for k, v in sorted(monitor.rss_growth.items())},
            "checks": dict(self.checks) | {"served_observations": monitor.observations,
                                           "verify_calls": monitor.verify_calls,
                                           "verify_races": monitor.verify_races},
            "wall_s": round(wall_s, 1),
            "workdir": str(self.work) if (self.config.keep_workdir or self.violations) else None,
        }


def run_chaos(config: ChaosConfig) -> dict:
    """Runs `config.rounds` rounds on a fresh cluster; returns the summary (see the module docstring)."""
    t0 = time.monotonic()
    run = Run(config)
    try:
        run.setup()
        run.warm_up()
        for number in range(1, config.rounds + 1):
            run.run_round(number)
    except Exception as e:  # noqa: BLE001 - the summary must still be printed, with the failure in it
        run.violation("harness", "driver", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        with contextlib.suppress(Exception):
            run.close()
    return run.summary(time.monotonic() - t0)


def _machine() -> dict:
    import torch

    import weightsync

    def git(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30,
                                  check=False).stdout.strip()
        return ""

    return {"cpus": os.cpu_count(), "arch": platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "load_avg": [round(x, 2) for x in os.getloadavg()],
            "code": str(Path(weightsync.__file__).resolve().parent.parent),
            "git_head": git("rev-parse", "--short", "HEAD"),
            "git_modified": git("status", "--short", "--untracked-files=no").splitlines()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["publisher"]:
        parser = argparse.ArgumentParser(prog="python -m bench.chaos publisher")
        parser.add_argument("--spec", required=True)
        return publisher_main(parser.parse_args(argv[1:]).spec)
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--store", choices=["local", "s3", "both"], default="local")
    parser.add_argument("--versions-per-round", type=int, default=3)
    parser.add_argument("--convergence-bound-s", type=float, default=60.0)
    parser.add_argument("--fault-scale", type=float, default=1.0, help="multiplies every fault's probability")
    parser.add_argument("--workdir", help="where processes keep caches and logs (default: a temp dir)")
    parser.add_argument("--keep-workdir", action="store_true", help="keep logs and caches (kept anyway on violations)")
    args = parser.parse_args(argv)

    def stop(signum, frame):  # SIGTERM (and SIGINT, which background shells ignore): clean up, then exit
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    machine = _machine()
    results = {}
    for store in (["local", "s3"] if args.store == "both" else [args.store]):
        config = ChaosConfig(rounds=args.rounds, seed=args.seed, store=store,
                             versions_per_round=args.versions_per_round, convergence_bound_s=args.convergence_bound_s,
                             fault_scale=args.fault_scale, keep_workdir=args.keep_workdir,
                             workdir=None if args.workdir is None else str(Path(args.workdir) / store))
        results[store] = run_chaos(config)
    machine["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    record = {"bench": "chaos", "command": "python -m bench.chaos " + " ".join(argv), "machine": machine,
              "violations": sum(r["violations"] for r in results.values()), "results": results}
    print(json.dumps(record, indent=1))
    return 1 if record["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
