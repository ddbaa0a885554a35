"""parity across devices: what the parity probe reports when trainer and engine run on different
hardware, dense and MoE (needs a CUDA GPU).

The "trainer" records the probe on the GPU, from the published (bf16) weights in bf16 and in fp32
(what `TrainingEngine.probe` does); "engines" answer the same prompts on the CPU in fp32, on the
CPU in bf16 and on the GPU in bf16, each held to the record of its own dtype (what an agent
does): a GPU trainer and a CPU engine differ by their kernels only. The random weights are scaled
x4 so that the logits are far from uniform, as a trained model's are. Last, the
`TrainingEngine.probe` path itself on CUDA (an NCCL world of one) against the plain staged forward.

Prints one JSON record (and writes it to --out). Run from the repository root on a GPU machine:
`python -m bench.parity_devices`. Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from weightsync.agents.parity_figures import compare
from weightsync.models import ModelConfig, build_model
from weightsync.models.probe import DEFAULT_PROMPTS, draw_prompts, run_probe, to_probe
from weightsync.trainer.config import ParallelConfig
from weightsync.trainer.engine import TrainingEngine
from weightsync.trainer.parallel import build_mesh, init_runtime

DENSE = ModelConfig(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
)
MOE = ModelConfig(
    **{k: getattr(DENSE, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")},
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    model_type="qwen3_moe",
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=704,
    norm_topk_prob=True,
)


def across_devices(arch: ModelConfig) -> dict:
    """The trainer's records (GPU, bf16 and fp32) against engines on CPU fp32, CPU bf16 and GPU bf16."""
    model = build_model(arch, seed=0)
    with torch.no_grad():  # random init gives near-uniform logits; a trained model's are peaked
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    published = {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()}
    on_gpu = {n: t.cuda() for n, t in published.items()}
    prompts = list(itertools.islice(draw_prompts(arch.vocab_size), DEFAULT_PROMPTS))
    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    t0 = time.perf_counter()
    records = run_probe(arch, prompts, on_gpu.__getitem__, dtypes=list(dtypes.values()), device="cuda")
    torch.cuda.synchronize()
    probe = to_probe(prompts, {name: records[dtype] for name, dtype in dtypes.items()})
    result = {"probe_bytes": len(json.dumps(probe.to_json())), "trainer_probe_s_cuda": time.perf_counter() - t0}
    engines = {"cpu_fp32": ("cpu", "float32"), "cpu_bf16": ("cpu", "bfloat16"), "cuda_bf16": ("cuda", "bfloat16")}
    for name, (device, dtype) in engines.items():
        weights = {n: t.to(device) for n, t in published.items()}
        t0 = time.perf_counter()
        run = run_probe(arch, prompts, weights.__getitem__, dtypes=[dtypes[dtype]], device=device)[dtypes[dtype]]
        figures = compare(probe, dtype, run.logprobs, run.experts)
        result[name] = dataclasses.asdict(figures) | {"probe_s": time.perf_counter() - t0}
    return result


def engine_probe_on_cuda() -> dict:
    """`TrainingEngine.probe` on an NCCL world of one against the plain staged forward."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29555", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    parallel = ParallelConfig()
    runtime = init_runtime(parallel)
    try:
        state = build_model(MOE, seed=1).state_dict()
        engine = TrainingEngine.build(
            MOE, state, mesh=build_mesh(parallel, runtime), parallel=parallel, device=runtime.device
        )
        prompts = list(itertools.islice(draw_prompts(MOE.vocab_size, length=16), 2))
        run = engine.probe(prompts, compute_dtypes=[torch.bfloat16])[torch.bfloat16]
        published = {n: t.to(torch.bfloat16).cuda() for n, t in state.items()}
        want = run_probe(MOE, prompts, published.__getitem__, dtypes=[torch.bfloat16], device="cuda")[torch.bfloat16]
        return {
            "backend": dist.get_backend(),
            "logprobs_equal": all(torch.equal(a, b) for a, b in zip(run.logprobs, want.logprobs, strict=True)),
            "experts_equal": all(torch.equal(a, b) for a, b in zip(run.experts, want.experts, strict=True)),
        }
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="also write the JSON record to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("bench.parity_devices needs a CUDA GPU\n")
        return 2
    record = {
        "bench": "parity_devices",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "dense": across_devices(DENSE),
        "moe": across_devices(MOE),
        "engine_probe_cuda": engine_probe_on_cuda(),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))
    sys.stdout.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
