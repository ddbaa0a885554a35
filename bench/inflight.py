"""inflight: publish() -> every agent serving, while requests of a given length run, per swap policy.

    .venv/bin/python -m bench.inflight                   # lengths 1, 10, 60 s; every policy
    .venv/bin/python -m bench.inflight --lengths 1,10 --versions 2 --label quick

For each swap policy (drain, in_flight, abort) one cluster: a store, a publisher pushing to a
leader agent that relays to a follower (one region, reference engines over HTTP, one torch thread
each). Two versions are served first, so that both agents double-buffer as in steady state.
Then, per request length (none, then each of `--lengths`): clients keep `--clients` requests
running on every agent's server back to back, each generating the number of tokens the engine
makes in that many seconds (calibrated on this machine; the measured request durations are
reported); after one request length of warm-up, `--versions` versions are published, each as
soon as the previous one is served everywhere, and publish() -> served on every agent is read
from the agents' ledgers (`served_unix_ms`). Under drain a new version waits for the requests
that started two swaps back (about one request length); under in_flight and abort for one
token step. The no-request figure of the same cluster is the baseline, measured in the same run.

Writes bench/results/inflight[-<label>]-<cores>cpu-<arch>-<date>.{json,md} and prints the JSON
record. Not a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.output import write_results
from harness.fake_trainer import FakeTrainer
from harness.machine import describe_machine
from weightsync.agents.config import AgentConfig
from weightsync.agents.server import AgentServer
from weightsync.models import ModelConfig
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.push import PushConfig, Pusher
from weightsync.store import LocalStore

log = logging.getLogger("bench.inflight")
RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "bench-inflight"
POLICIES = ("drain", "in_flight", "abort")
ARCH = ModelConfig(vocab_size=259, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32768)
"""The demo's model (~0.8M parameters) with room for long generations."""
PROMPT = [256, 72, 105, 33]
WAIT_S = 300.0


def start_cluster(root: Path, policy: str, max_new_tokens: int) -> tuple[Publisher, Pusher, dict[str, AgentServer]]:
    store = LocalStore(root / "store")
    engine = {"type": "reference", "model": {f: getattr(ARCH, f) for f in ARCH.__dataclass_fields__}, "port": 0,
              "torch_threads": 1, "max_concurrent_requests": 4, "max_new_tokens_limit": max_new_tokens,
              "queue_timeout_s": WAIT_S}
    agents: dict[str, AgentServer] = {}
    peers: tuple[str, ...] = ()
    for name in ("follower", "leader"):
        config = AgentConfig(model=MODEL, cache_dir=str(root / name), name=name, store=store.uri, peers=peers,
                             engine=engine, swap_policy=policy, workers=1, poll_interval_s=2.0, push_wait_s=5.0)
        agents[name] = AgentServer(config).start()
        peers = (agents[name].address,)
    pusher = Pusher(PushConfig(targets=(agents["leader"].address,), model=MODEL, give_up_after_s=WAIT_S))
    publisher = Publisher(store, model=MODEL, config=PublisherConfig(workers=1), listeners=[pusher])
    return publisher, pusher, agents


def publish_and_time(publisher: Publisher, trainer: FakeTrainer, agents: dict[str, AgentServer]) -> dict:
    """One version: publish() -> every agent serving, and where each agent's time went."""
    trainer.step()
    call_ms = time.time() * 1000
    version = publisher.publish(trainer.state_dict(), step=trainer.step_count).result().version
    per_agent = {}
    for name, server in agents.items():
        if not server.agent.wait_for_version(version, WAIT_S):
            raise TimeoutError(f"{name} did not serve v{version} in {WAIT_S} s")
        entry = next(e for e in server.agent.status()["ledger"] if e["version"] == version)
        per_agent[name] = {"to_serving_s": (entry["served_unix_ms"] - call_ms) / 1000,
                           "drain_s": entry["timings_s"].get("drain", 0.0)}
    return {"version": version, "to_all_agents_s": max(a["to_serving_s"] for a in per_agent.values()),
            "agents": per_agent}


class Clients:
    """Keeps `per_server` requests of `max_new_tokens` running on every server, back to back."""

    def __init__(self, urls: list[str], per_server: int, max_new_tokens: int) -> None:
        self.body = json.dumps({"prompt_ids": [PROMPT], "max_new_tokens": max_new_tokens, "stop": None,
                                "temperature": 1.0}).encode()
        self.stop = threading.Event()
        self.durations: list[float] = []
        self.spanning = self.restarts = self.errors = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(url,), daemon=True)
                         for url in urls for _ in range(per_server)]
        for t in self._threads:
            t.start()

    def _loop(self, url: str) -> None:
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                request = urllib.request.Request(url + "/v1/generate", data=self.body,
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=WAIT_S) as reply:
                    answer = json.loads(reply.read())
            except OSError as e:
                log.warning("request to %s failed: %s", url, e)
                with self._lock:
                    self.errors += 1
                self.stop.wait(0.5)
                continue
            with self._lock:
                self.durations.append(time.monotonic() - started)
                self.spanning += len(answer["weight_versions"]) > 1
                self.restarts += answer["restarts"]

    def close(self) -> dict:
        self.stop.set()
        for t in self._threads:
            t.join(WAIT_S)
        d = self.durations
        return {"requests": len(d), "request_s_median": statistics.median(d) if d else None,
                "request_s_max": max(d) if d else None, "spanning_versions": self.spanning,
                "restarts": self.restarts, "errors": self.errors}


def calibrate_tokens_per_s(agents: dict[str, AgentServer]) -> float:
    """Tokens per second one request gets while every server runs `clients` of them (measured)."""
    engine = agents["leader"].engine
    generated = 0
    started = time.monotonic()
    while time.monotonic() - started < 3.0:
        generation = engine.generate([PROMPT], max_new_tokens=256, temperature=1.0, stop=None)
        generated += len(generation.completions[0].token_ids)
    return generated / (time.monotonic() - started)


def run_policy(policy: str, lengths: list[float], versions: int, clients: int, root: Path) -> dict:
    max_tokens = 30000
    publisher, pusher, agents = start_cluster(root / policy, policy, max_tokens)
    try:
        trainer = FakeTrainer(config=ARCH)
        for _ in range(2):  # both buffers in use, as in steady state
            publish_and_time(publisher, trainer, agents)
        # Per-request speed with every server as busy as during the cells (`clients` each).
        urls = [server.engine.url for server in agents.values()]
        load = Clients(urls, clients - 1, 256) if clients > 1 else None
        tokens_per_s = calibrate_tokens_per_s(agents)
        if load is not None:
            load.close()
        cells = []
        for length in [0.0, *lengths]:
            tokens = min(max_tokens, max(1, round(length * tokens_per_s)))
            running = Clients(urls, clients, tokens) if length else None
            if running is not None:
                time.sleep(min(length, 10.0))  # requests of every age are running
            rows = [publish_and_time(publisher, trainer, agents) for _ in range(versions)]
            requests = running.close() if running is not None else {}
            times = [r["to_all_agents_s"] for r in rows]
            cells.append({"policy": policy, "request_s": length, "request_tokens": tokens if length else 0,
                          "to_all_agents_s_median": statistics.median(times), "to_all_agents_s_max": max(times),
                          "drain_s_max": max(a["drain_s"] for r in rows for a in r["agents"].values()),
                          "versions": rows, "requests": requests})
            log.info("%s, %s s requests: publish() -> all serving median %.2f s, max %.2f s; %s", policy, length,
                     cells[-1]["to_all_agents_s_median"], cells[-1]["to_all_agents_s_max"], requests)
        return {"tokens_per_s": tokens_per_s, "cells": cells}
    finally:
        publisher.close()
        pusher.close(timeout_s=5)
        for server in agents.values():
            server.stop(0)


def markdown(record: dict) -> str:
    lengths = record["config"]["lengths"]
    lines = [f"# publish() -> every agent serving, with requests running ({record['date']})", "",
             "Median (max) seconds over the versions of each cell; x: median over the same policy's no-request "
             "median. Measured request durations in the JSON.", "",
             "| policy | no requests | " + " | ".join(f"{x:g} s requests" for x in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for policy, result in record["results"].items():
        cells = result["cells"]
        base = cells[0]["to_all_agents_s_median"]
        row = [f"{c['to_all_agents_s_median']:.2f} ({c['to_all_agents_s_max']:.2f})"
               + (f" {c['to_all_agents_s_median'] / base:.1f}x" if c["request_s"] else "") for c in cells]
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
    record = {"bench": "inflight", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": describe_machine(), "loadavg_before": Path("/proc/loadavg").read_text().split()[:3],
              "config": {"lengths": lengths, "policies": policies, "versions": args.versions,
                         "clients": args.clients, "model": str(ARCH)}, "results": {}}
    with tempfile.TemporaryDirectory(prefix="ws-bench-inflight-") as tmp:
        for policy in policies:
            record["results"][policy] = run_policy(policy, lengths, args.versions, args.clients, Path(tmp))
    record["loadavg_after"] = Path("/proc/loadavg").read_text().split()[:3]
    machine = record["machine"]
    name = "-".join(x for x in ("inflight", args.label, f"{machine['cores']}cpu", machine["machine"],
                                record["date"][:10]) if x)
    write_results(RESULTS / name, record, markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
