"""swap benchmark: how long the reference server holds new requests back when a version is swapped in.

For a small (~120 MiB of bf16 weights) and a large (~1 GiB) model, a `ReferenceServer` with
compute_dtype bfloat16 (the zero-copy path) answers HTTP generate requests from client threads in
another process, which send them without pause, while the bench swaps N versions in. Versions
alternate between two weight buffers as an agent's double buffering does, and before a buffer is
reused the bench waits for `wait_unused` on the version that last used it, as the agent must.

Reported per model: the pause (`SwapReport.pause_s`, the time new requests are held back)
p50/p99/max, the whole `swap` call (layout check + flip), the wait before a buffer can be reused,
requests in flight at each flip, and client-side counts (responses, errors, versions seen).
Baselines measured in the same run: the same swaps on an idle server, and the pause of an engine
that copies the new weights into its served buffers while holding requests (one `copy_` of the
whole model). On the small model it also measures generation speed with compute_dtype bfloat16
vs float32, which is what decides the setting on a given CPU.

Prints one JSON record. Run from the repository root: `python -m bench.swap [--quick]`. Not a
test: it asserts no times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness.machine import describe_machine
from weightsync import __version__
from weightsync.agents.engines.reference_server import ReferenceServer, ReferenceServerConfig
from weightsync.models import CausalLM, ModelConfig

log = logging.getLogger("bench.swap")

MODELS = {
    "small": ModelConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
    "large": ModelConfig(
        vocab_size=32000,
        hidden_size=1536,
        intermediate_size=4608,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
}

# The load generator: stdlib only (starts in milliseconds), in its own process so that its threads
# do not compete with the server for the GIL, as real clients would not. Runs until stdin closes.
_CLIENTS = r"""
import json, sys, threading, urllib.request
url, clients, body = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode()
stop = threading.Event()
stats = {"responses": 0, "errors": 0, "versions": set(), "backwards": 0}
lock = threading.Lock()
def client():
    last = -1
    while not stop.is_set():
        try:
            req = urllib.request.Request(url + "/v1/generate", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as reply:
                version = json.loads(reply.read())["weight_version"]
            with lock:
                stats["responses"] += 1
                stats["versions"].add(version)
                stats["backwards"] += version < last
            last = version
        except Exception:
            with lock:
                stats["errors"] += 1
threads = [threading.Thread(target=client) for _ in range(clients)]
for t in threads:
    t.start()
print("started", flush=True)
sys.stdin.read()
stop.set()
for t in threads:
    t.join()
print(json.dumps({**stats, "versions": len(stats["versions"])}), flush=True)
"""


def random_weights(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """bf16 weights with the model's names and shapes (values like a trained model's scale)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in CausalLM(config).to("meta").state_dict().items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(t.shape, dtype=torch.bfloat16)
        else:
            out[name] = (torch.randn(t.shape, generator=g) * 0.02).to(torch.bfloat16)
    return out


def percentiles_ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] * 1e3

    return {"p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": ordered[-1] * 1e3, "n": len(ordered)}


def run_swaps(
    server: ReferenceServer, buffers: list[dict[str, torch.Tensor]], swaps: int, interval_s: float, first_version: int
) -> dict:
    """`swaps` versions, alternating buffers; waits for wait_unused before a buffer is reused."""
    pauses, totals, reuse_waits, in_flight = [], [], [], []
    for i in range(swaps):
        version = first_version + i
        if i >= 2:
            started = time.perf_counter()
            if not server.wait_unused(version - 2, 600):
                raise RuntimeError(f"version {version - 2} still in use after 600 s")
            reuse_waits.append(time.perf_counter() - started)
        time.sleep(interval_s)
        in_flight.append(server.requests_in_flight())
        report = server.swap(version, buffers[i % 2], digest=f"bench-{version}")
        pauses.append(report.pause_s)
        totals.append(report.total_s)
    return {
        "pause": percentiles_ms(pauses),
        "swap_call": percentiles_ms(totals),
        "buffer_reuse_wait": percentiles_ms(reuse_waits) if reuse_waits else None,
        "in_flight_at_flip": {"mean": statistics.mean(in_flight), "max": max(in_flight)},
    }


def copy_baseline_s(buffers: list[dict[str, torch.Tensor]], repeats: int = 3) -> float:
    """What an engine that copies weights into its served tensors holds requests back for."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for name, dst in buffers[0].items():
            dst.copy_(buffers[1][name])
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def bench_model(name: str, config: ModelConfig, *, swaps: int, interval_s: float, clients: int, request: dict) -> dict:
    buffers = [random_weights(config, seed) for seed in (1, 2)]
    nbytes = sum(t.numel() * t.element_size() for t in buffers[0].values())
    log.info("%s: %.0f MiB of bf16 weights, %d tensors", name, nbytes / 2**20, len(buffers[0]))
    result = {
        "model": {**config.to_hf(), "weight_bytes": nbytes, "tensors": len(buffers[0])},
        "request": request,
        "clients": clients,
        "interval_s": interval_s,
    }
    server_config = ReferenceServerConfig(model=config, max_concurrent_requests=clients)
    with ReferenceServer(server_config) as server:
        server.swap(0, buffers[1], digest="bench-0")
        result["idle"] = run_swaps(server, buffers, swaps, 0.0, first_version=1)
        client = subprocess.Popen(
            [sys.executable, "-c", _CLIENTS, server.url, str(clients), json.dumps(request)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            client.stdout.readline()
            first = swaps + 1
            while server.requests_in_flight() < clients:  # load is on before the first timed swap
                time.sleep(0.01)
            started = time.perf_counter()
            result["under_load"] = run_swaps(server, buffers, swaps, interval_s, first_version=first)
            result["under_load"]["seconds"] = time.perf_counter() - started
            client.stdin.close()
            result["client"] = json.loads(client.stdout.readline())
        finally:
            if client.poll() is None:
                client.kill()
            client.wait()
    result["baseline_copy_pause_ms"] = copy_baseline_s(buffers) * 1e3
    log.info(
        "%s: pause under load %s; copy baseline %.1f ms",
        name,
        result["under_load"]["pause"],
        result["baseline_copy_pause_ms"],
    )
    return result


def bench_compute_dtype(config: ModelConfig, repeats: int) -> dict:
    """Generation tokens/s for each compute_dtype (in-process, no HTTP), same weights."""
    weights = random_weights(config, 3)
    prompts = [[(7 * i + j) % config.vocab_size for j in range(32)] for i in range(4)]
    out = {}
    for dtype in ("bfloat16", "float32"):
        server = ReferenceServer(ReferenceServerConfig(model=config, compute_dtype=dtype))
        server.swap(1, weights, digest="bench")
        server.generate(prompts, max_new_tokens=2, stop=None)  # warm-up
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            server.generate(prompts, max_new_tokens=32, stop=None)
            times.append(time.perf_counter() - started)
        out[dtype] = {
            "tokens_per_s": len(prompts) * 32 / statistics.median(times),
            "batch": len(prompts),
            "prompt_tokens": 32,
            "new_tokens": 32,
        }
        server.close()
    out["float32_speedup"] = out["float32"]["tokens_per_s"] / out["bfloat16"]["tokens_per_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer swaps (about 1 minute)")
    parser.add_argument("--models", default="small,large", help="comma-separated: small, large")
    parser.add_argument("--clients", type=int, default=2, help="client threads sending requests without pause")
    parser.add_argument("--out", default=None, help="also write the JSON record to this file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("weightsync").setLevel(logging.WARNING)
    load_before = os.getloadavg()
    plans = {
        "small": (50 if args.quick else 200, 0.02, {"prompt_ids": [[5] * 16], "max_new_tokens": 8}),
        "large": (12 if args.quick else 40, 0.05, {"prompt_ids": [[5] * 8], "max_new_tokens": 2}),
    }
    results = {}
    for name in args.models.split(","):
        swaps, interval_s, request = plans[name]
        results[name] = bench_model(
            name, MODELS[name], swaps=swaps, interval_s=interval_s, clients=args.clients, request=request
        )
    results["compute_dtype"] = bench_compute_dtype(MODELS["small"], repeats=1 if args.quick else 3)
    record = {
        "bench": "swap",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "target": "swap pause <= 10 ms",
        "versions": {"weightsync": __version__, "python": platform.python_version(), "torch": torch.__version__},
        "hardware": describe_machine(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "results": results,
    }
    text = json.dumps(record)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
