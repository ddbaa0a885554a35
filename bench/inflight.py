"""inflight: publish() -> every agent serving, while requests of a given length run, per swap policy.

    .venv/bin/python -m bench.inflight                   # lengths 1, 10, 60 s; every policy
    .venv/bin/python -m bench.inflight --lengths 1,10 --versions 2 --label quick

For each swap policy (drain, in_flight, abort) one cluster: a store, a publisher (this process)
pushing to a leader agent that relays to a follower (one region; `weightsync agent` processes with
reference engines over HTTP, one torch thread each). Two versions are served first, so that both agents double-buffer as in steady state.
Then, per request length (none, then each of `--lengths`): clients keep `--clients` requests
running on every agent's server back to back, each generating the number of tokens the engine
makes in that many seconds (calibrated on this machine and load as a*n + b*n^2; the measured
request durations are reported); after one request length of warm-up, `--versions` versions are published, each as
soon as the previous one is served everywhere, and publish() -> served on every agent is read
from the agents' ledgers (`served_unix_ms`). Under drain a new version waits for the requests
that started two swaps back (about one request length); under in_flight and abort for one
token step. The no-request figure of the same cluster is the baseline, measured in the same run.

Agents run niced (AGENT_NICE) so that the publisher in this process, which stands in for the
trainer's machines, is not starved by generation on the two shared cores; the ledgers' agent-side
time (offer -> serving) is reported beside publish() -> serving.

Writes bench/results/inflight[-<label>]-<cores>cpu-<arch>-<date>.{json,md} and prints the JSON
record. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.output import write_results
from harness.fake_trainer import FakeTrainer
from harness.machine import describe_machine
from weightsync.models import ModelConfig
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.stores import LocalStore
from weightsync.transport.push import PushConfig, Pusher
from weightsync.transport.rpc import AgentClient

log = logging.getLogger("bench.inflight")
RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "bench-inflight"
POLICIES = ("drain", "in_flight", "abort")
ARCH = ModelConfig(
    vocab_size=259,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32768,
)
"""~13M parameters (a step is mostly matmuls, not Python), with room for long generations."""
PROMPT = [256, 72, 105, 33]
WAIT_S = 300.0
AGENT_NICE = 10
"""Agents (and the generation in their engines) run at a lower priority than the publisher: in a
real job the trainer has machines of its own, and here two cores are shared by all of them."""


class Cluster:
    """A store, a publisher pushing to a leader agent that relays to a follower; each agent is a
    `weightsync agent` process with its reference engine, as users run them (so the publisher
    in this process and generation in the agents' do not share a GIL), stopped by PID."""

    def __init__(self, root: Path, policy: str, max_new_tokens: int) -> None:
        root.mkdir(parents=True)
        self.store = LocalStore(root / "store")
        arch = "\n".join(f"{f} = {json.dumps(getattr(ARCH, f))}" for f in ARCH.__dataclass_fields__)
        self.procs: list[subprocess.Popen] = []
        self.agents: dict[str, dict] = {}
        peers: list[str] = []
        for name in ("follower", "leader"):
            toml = root / f"{name}.toml"
            toml.write_text(
                f'[agent]\nmodel = "{MODEL}"\nname = "{name}"\ncache_dir = "{root / name}"\n'
                f'store = "{self.store.uri}"\npeers = {json.dumps(peers)}\nswap_policy = "{policy}"\n'
                "workers = 1\npoll_interval_s = 2.0\npush_wait_s = 5.0\n"
                '[agent.engine]\ntype = "reference"\nport = 0\ntorch_threads = 1\nmax_concurrent_requests = 4\n'
                f"max_new_tokens_limit = {max_new_tokens}\nqueue_timeout_s = {WAIT_S}\n"
                f"[agent.engine.model]\n{arch}\n"
            )
            proc = subprocess.Popen(
                [sys.executable, "-m", "weightsync.app.cli", "agent", "--config", str(toml)],
                stdout=subprocess.PIPE,
                stderr=open(root / f"{name}.log", "w"),
                text=True,
                start_new_session=True,
                preexec_fn=lambda: os.nice(AGENT_NICE),
            )
            self.procs.append(proc)
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"agent {name} exited; see {root / (name + '.log')}")
            ready = json.loads(line)
            self.agents[name] = {
                "address": ready["address"],
                "url": ready["engine_url"],
                "client": AgentClient(ready["address"]),
            }
            peers = [ready["address"]]
        self.pusher = Pusher(
            PushConfig(targets=(self.agents["leader"]["address"],), model=MODEL, give_up_after_s=WAIT_S)
        )
        self.publisher = Publisher(self.store, model=MODEL, config=PublisherConfig(workers=1), listeners=[self.pusher])

    @property
    def urls(self) -> list[str]:
        return [a["url"] for a in self.agents.values()]

    def publish_and_time(self, trainer: FakeTrainer) -> dict:
        """One version: publish() -> every agent serving, and where each agent's time went."""
        trainer.step()
        call_ms = time.time() * 1000
        version = self.publisher.publish(trainer.state_dict(), step=trainer.step_count).result().version
        per_agent = {}
        deadline = time.monotonic() + WAIT_S
        for name, agent in self.agents.items():
            while (status := agent["client"].status()).current_version < version:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not serve v{version} in {WAIT_S} s")
                time.sleep(0.02)
            entry = next(e for e in status.ledger if e.version == version)
            timings = dict(entry.timings_s)
            per_agent[name] = {
                "to_serving_s": (entry.served_unix_ms - call_ms) / 1000,
                "drain_s": timings.get("drain", 0.0),
                "ledger_timings_s": timings,
            }
        return {
            "version": version,
            "to_all_agents_s": max(a["to_serving_s"] for a in per_agent.values()),
            "agents": per_agent,
        }

    def close(self) -> None:
        self.publisher.close()
        self.pusher.close(timeout_s=5)
        for agent in self.agents.values():
            agent["client"].close()
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class Clients:
    """Keeps `per_server` requests of `max_new_tokens` running on every server, back to back."""

    def __init__(self, urls: list[str], per_server: int, max_new_tokens: int) -> None:
        self.body = json.dumps(
            {"prompt_ids": [PROMPT], "max_new_tokens": max_new_tokens, "stop": None, "temperature": 1.0}
        ).encode()
        self.stop = threading.Event()
        self.durations: list[float] = []
        self.spanning = self.restarts = self.errors = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._loop, args=(url,), daemon=True) for url in urls for _ in range(per_server)
        ]
        for t in self._threads:
            t.start()

    def _loop(self, url: str) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                request = urllib.request.Request(
                    url + "/v1/generate", data=self.body, headers={"Content-Type": "application/json"}
                )
                with urllib.request.urlopen(request, timeout=WAIT_S) as reply:
                    answer = json.loads(reply.read())
            except OSError as e:
                if self.stop.is_set():
                    return  # the cluster stopped under a request left running
                log.warning("request to %s failed: %s", url, e)
                with self._lock:
                    self.errors += 1
                self.stop.wait(0.5)
                continue
            with self._lock:
                self.durations.append(time.monotonic() - started)
                self.spanning += len(answer["weight_versions"]) > 1
                self.restarts += answer["restarts"]

    def close(self, *, wait: bool = True) -> dict:
        """Stops issuing requests; with `wait`, lets those running end (they would load the next
        cell), else leaves them to the cluster's end. Statistics of the requests that ended."""
        self.stop.set()
        for t in self._threads if wait else ():
            t.join(WAIT_S)
        d = self.durations
        return {
            "requests": len(d),
            "request_s_median": statistics.median(d) if d else None,
            "request_s_max": max(d) if d else None,
            "spanning_versions": self.spanning,
            "restarts": self.restarts,
            "errors": self.errors,
        }


def calibrate(url: str) -> tuple[float, float]:
    """(a, b) of a request's duration t(n) = a*n + b*n^2 for n new tokens, measured over HTTP while
    the servers are as busy as in the cells (a step's cost grows with the context: the n^2)."""
    points = []
    for n in (256, 1024, 256, 1024):
        body = json.dumps({"prompt_ids": [PROMPT], "max_new_tokens": n, "stop": None}).encode()
        started = time.monotonic()
        request = urllib.request.Request(url + "/v1/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=WAIT_S) as reply:
            reply.read()
        points.append((n, time.monotonic() - started))
    t1 = statistics.fmean(t for n, t in points if n == 256)
    t2 = statistics.fmean(t for n, t in points if n == 1024)
    # t1 = 256 a + 256^2 b, t2 = 1024 a + 1024^2 b
    b = max(0.0, (t2 - 4 * t1) / (1024**2 - 4 * 256**2))
    a = max(1e-6, (t1 - 256**2 * b) / 256)
    return a, b


def tokens_for(seconds: float, a: float, b: float) -> int:
    """The n with a*n + b*n^2 = seconds."""
    if b <= 0:
        return round(seconds / a)
    return round((-a + (a * a + 4 * b * seconds) ** 0.5) / (2 * b))


def run_policy(policy: str, lengths: list[float], versions: int, clients: int, root: Path) -> dict:
    max_tokens = 30000
    cluster = Cluster(root / policy, policy, max_tokens)
    try:
        trainer = FakeTrainer(config=ARCH)
        for _ in range(2):  # both buffers in use, as in steady state
            cluster.publish_and_time(trainer)
        # as busy as in the cells: `clients` requests per server, calibration's own included
        load = Clients(cluster.urls[:-1], clients, 256), Clients(cluster.urls[-1:], clients - 1, 256)
        a, b = calibrate(cluster.urls[-1])
        for clients_ in load:
            clients_.close()
        cells = []
        for length in [0.0, *lengths]:
            tokens = min(max_tokens, max(1, tokens_for(length, a, b)))
            running = Clients(cluster.urls, clients, tokens) if length else None
            if running is not None:
                time.sleep(min(length, 10.0))  # requests of every age are running
            rows = [cluster.publish_and_time(trainer) for _ in range(versions)]
            requests = running.close() if running is not None else {}  # the spanning ones ended too
            times = [r["to_all_agents_s"] for r in rows]
            agent_side = [
                max(a["ledger_timings_s"].get("since_offer", 0.0) for a in r["agents"].values()) for r in rows
            ]
            cells.append(
                {
                    "policy": policy,
                    "request_s": length,
                    "request_tokens": tokens if length else 0,
                    "to_all_agents_s_median": statistics.median(times),
                    "to_all_agents_s_max": max(times),
                    "offer_to_serving_s_median": statistics.median(agent_side),
                    "drain_s_max": max(a["drain_s"] for r in rows for a in r["agents"].values()),
                    "versions": rows,
                    "requests": requests,
                }
            )
            log.info(
                "%s, %s s requests: publish() -> all serving median %.2f s, max %.2f s; %s",
                policy,
                length,
                cells[-1]["to_all_agents_s_median"],
                cells[-1]["to_all_agents_s_max"],
                requests,
            )
        return {"request_s_per_token": a, "request_s_per_token_squared": b, "cells": cells}
    finally:
        cluster.close()


def markdown(record: dict) -> str:
    lengths = record["config"]["lengths"]
    lines = [
        f"# publish() -> every agent serving, with requests running ({record['date']})",
        "",
        "Median (max) seconds over the versions of each cell; x: median over the same policy's no-request "
        "median. Measured request durations in the JSON.",
        "",
        "| policy | no requests | " + " | ".join(f"{x:g} s requests" for x in lengths) + " |",
        "|---|---|" + "---|" * len(lengths),
    ]
    for policy, result in record["results"].items():
        cells = result["cells"]
        base = cells[0]["to_all_agents_s_median"]
        row = [
            f"{c['to_all_agents_s_median']:.2f} ({c['to_all_agents_s_max']:.2f})"
            + (f" {c['to_all_agents_s_median'] / base:.1f}x" if c["request_s"] else "")
            for c in cells
        ]
        lines.append(f"| {policy} | " + " | ".join(row) + " |")
    lines += [
        "",
        "Measured request durations (median s) and responses that spanned versions / restarts:",
        "",
        "| policy | " + " | ".join(f"{x:g} s requests" for x in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for policy, result in record["results"].items():
        row = [
            f"{c['requests']['request_s_median']:.1f} s, {c['requests']['spanning_versions']} spanning, "
            f"{c['requests']['restarts']} restarts"
            if c["requests"].get("request_s_median")
            else "-"
            for c in result["cells"][1:]
        ]
        lines.append(f"| {policy} | " + " | ".join(row) + " |")
    lines += ["", f"Load average before / after: {record['loadavg_before']} / {record['loadavg_after']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.inflight", description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="1,10,60", help="request lengths in seconds (default 1,10,60)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--versions", type=int, default=3, help="versions published per cell (default 3)")
    parser.add_argument("--clients", type=int, default=2, help="requests kept running per server (default 2)")
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("weightsync").setLevel(logging.WARNING)
    lengths = [float(x) for x in args.lengths.split(",") if x]
    policies = [p for p in args.policies.split(",") if p]
    record = {
        "bench": "inflight",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": describe_machine(),
        "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
        "config": {
            "lengths": lengths,
            "policies": policies,
            "versions": args.versions,
            "clients": args.clients,
            "model": str(ARCH),
        },
        "results": {},
    }
    with tempfile.TemporaryDirectory(prefix="ws-bench-inflight-") as tmp:
        for policy in policies:
            record["results"][policy] = run_policy(policy, lengths, args.versions, args.clients, Path(tmp))
    record["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    machine = record["machine"]
    name = "-".join(
        x for x in ("inflight", args.label, f"{machine['cores']}cpu", machine["machine"], record["date"][:10]) if x
    )
    write_results(RESULTS / name, record, markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
