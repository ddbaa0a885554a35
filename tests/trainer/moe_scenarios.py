"""MoE jobs that tests/trainer/test_moe_trainer.py launches under torchrun (not a test module).

    torchrun --standalone --nproc-per-node 2 tests/trainer/moe_scenarios.py OUT_DIR

One launch, several small jobs on a tiny Qwen3-MoE (8 experts, top-2; the test's TINY), rank 0
leaving what the tests assert on in OUT_DIR/moe.pt:

- full: `trainer/configs/sft_moe_tiny.toml` itself for 20 steps (a batch of 8) (the loop's metrics, the aux
  loss among them), publishing every 10 steps; then a DCP save of its engine, loaded by a fresh
  engine: both states gathered before and after one more identical step.
- lora: the same job with a LoRA engine (attention + router + lm_head adapters, experts frozen)
  swapped in; the merged router weight next to the gathered base weight and adapters.
- grads: one forward_backward with the aux loss on a padded batch split over the ranks, the
  gathered gradients (the test recomputes them on one unsharded model).
- grpo: `trainer/configs/grpo_moe_tiny.toml` (KL to a frozen MoE reference) for 3 steps.
- all_to_all: what expert parallelism would dispatch with, gloo on CPU tensors, uneven splits.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from weightsync.models import ModelConfig, build_model
from weightsync.trainer.config import ParallelConfig, PublishConfig, load_job_config
from weightsync.trainer.engine import TrainingEngine
from weightsync.trainer.lora import LoraSettings
from weightsync.trainer.losses import LossSums
from weightsync.trainer.optim import AdamWParams
from weightsync.trainer.parallel import build_mesh, close_runtime, exit_worker, init_runtime
from weightsync.trainer.probe import choose_prompts
from weightsync.trainer.train import Trainer, configure_logging

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "trainer" / "configs"
LORA = LoraSettings(rank=4, seed=1)
GRAD_COEF = 0.5
"""A large aux weight for the gradient check, so its share of the router's gradient is not noise."""


def sft_job(out: Path, name: str, steps: int = 20):
    return load_job_config(
        CONFIGS / "sft_moe_tiny.toml",
        [
            f"train.steps={steps}",
            "train.log_every=100",
            f'train.checkpoint.dir="{out / name / "ckpt"}"',
            f'train.publish.store="{out / name / "store"}"',
            "train.publish.every_steps=10",
            "train.data.global_batch_size=8",  # 4 per rank: one micro-batch
        ],
    )


def run_full(out: Path, results: dict) -> None:
    trainer = Trainer(sft_job(out, "full"))
    try:
        results["full"] = trainer.train()
        engine = trainer.engine
        engine.save(out / "dcp")
        architecture = trainer.job.train.model.architecture
        initial = build_model(architecture, seed=99).state_dict() if trainer.rank == 0 else None
        fresh = TrainingEngine.build(
            architecture, initial, mesh=trainer.mesh, parallel=trainer.job.parallel, device=trainer.device
        )
        fresh.load(out / "dcp")
        results["dcp_saved"], results["dcp_loaded"] = engine.full_state_dict(), fresh.full_state_dict()
        batch = trainer.next_micro_batches()[0]
        for e in (engine, fresh):
            e.forward_backward(
                batch.input_ids, batch.targets, lambda lp: LossSums(-(lp * batch.loss_weights).sum(), {}), divisor=64.0
            )
            e.optimizer_step(AdamWParams(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0))
        results["dcp_saved_next"], results["dcp_loaded_next"] = engine.full_state_dict(), fresh.full_state_dict()
        # The parity probe on 2 ranks: the run's prompts (repaired until every router picks every
        # expert), the records of the published weights with each layer's expert choices.
        config = PublishConfig(store="unused", probe_prompts=2, probe_tokens=16)
        prompts = choose_prompts(engine, config)
        runs = engine.probe(prompts, compute_dtypes=[torch.bfloat16, torch.float32])
        results["probe_prompts"], results["probe_runs"] = prompts, runs
        results["probe_architecture"] = architecture
        results["probe_weights"] = engine.full_state_dict()  # put back bit for bit after the probe
    finally:
        trainer.close()


def run_lora(out: Path, results: dict) -> None:
    trainer = Trainer(sft_job(out, "lora"))
    # The TOML loop has no LoRA section: swap in a LoRA engine of the same weights (test-only).
    spec = trainer.job.train.model
    initial = build_model(spec.architecture, seed=spec.init_seed).state_dict() if trainer.rank == 0 else None
    trainer.engine = TrainingEngine.build(
        spec.architecture, initial, mesh=trainer.mesh, parallel=trainer.job.parallel, device=trainer.device, lora=LORA
    )
    try:
        results["lora"] = trainer.train()
        engine = trainer.engine
        results["lora_targets"] = engine.lora_targets
        results["lora_trainable"] = [n for n, p in engine.model.named_parameters() if p.requires_grad]
        router = "model.layers.0.mlp.gate"
        merged = engine.weights("merged")[f"{router}.weight"].full_tensor()
        full = engine.full_state_dict()
        if trainer.rank == 0:
            results["lora_router"] = {
                "merged": merged,
                "base": full[f"{router}.weight"],
                "A": full[f"{router}.lora_A.weight"],
                "B": full[f"{router}.lora_B.weight"],
                "scale": LORA.scale,
            }
    finally:
        trainer.close()


def run_grads(results: dict, architecture: ModelConfig) -> None:
    runtime = init_runtime(ParallelConfig(device="cpu"))
    parallel = ParallelConfig(device="cpu")
    mesh = build_mesh(parallel, runtime)
    rank, ranks = runtime.rank, runtime.world_size
    initial = build_model(architecture, seed=5).state_dict() if rank == 0 else None
    engine = TrainingEngine.build(architecture, initial, mesh=mesh, parallel=parallel, device=runtime.device)
    tokens = torch.randint(0, architecture.vocab_size, (4, 11), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([10, 7, 4, 9])  # next-token positions per row; the rest is padding
    mask = torch.arange(10) < lengths[:, None]
    mine = slice(rank, None, ranks)
    engine.forward_backward(
        tokens[mine, :-1],
        tokens[mine, 1:],
        lambda lp: LossSums(-(lp * mask[mine]).sum(), {}),
        divisor=float(mask.sum()),
        token_mask=mask[mine],
        step_tokens=float(mask.sum()),
    )
    results["grads"] = {
        "architecture": architecture,
        "tokens": tokens,
        "mask": mask,
        "initial": initial,
        "grads": {n: p.grad.full_tensor() for n, p in engine.model.named_parameters()},
    }


def run_grpo(out: Path, results: dict) -> None:
    job = load_job_config(
        CONFIGS / "grpo_moe_tiny.toml",
        [
            "train.steps=3",
            "train.log_every=100",
            f'train.data.path="{CONFIGS / "grpo_moe_tiny.jsonl"}"',
            f'train.checkpoint.dir="{out / "grpo" / "ckpt"}"',
            f'train.publish.store="{out / "grpo" / "store"}"',
        ],
    )
    trainer = Trainer(job)
    try:
        results["grpo"] = trainer.train()
    finally:
        trainer.close()


def run_all_to_all(results: dict) -> None:
    """Rank r sends r+1 rows to each rank (uneven), as a token dispatch to experts would."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    send = torch.full(((rank + 1) * ranks, 3), float(rank))
    received = torch.empty((sum(r + 1 for r in range(ranks)), 3))
    # Output splits: what each rank sends here; input splits: what this rank sends to each.
    dist.all_to_all_single(received, send, [r + 1 for r in range(ranks)], [rank + 1] * ranks)
    results["all_to_all"] = received[:, 0].tolist()


def main() -> None:
    out = Path(sys.argv[1])
    runtime = init_runtime(ParallelConfig(device="cpu"))
    configure_logging("WARNING")
    results: dict = {}
    run_full(out, results)
    run_lora(out, results)
    architecture = load_job_config(CONFIGS / "sft_moe_tiny.toml").train.model.architecture
    run_grads(results, dataclasses.replace(architecture, router_aux_loss_coef=GRAD_COEF))
    run_grpo(out, results)
    run_all_to_all(results)
    if runtime.rank == 0:
        torch.save(results, out / "moe.pt")
    dist.barrier()
    close_runtime(runtime)
    exit_worker(0)  # the gloo group outlives close_runtime (FSDP holds it): see exit_worker


if __name__ == "__main__":
    main()
