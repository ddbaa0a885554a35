"""Scenarios the distributed trainer tests launch under torchrun (not a test module itself).

    torchrun --standalone --nproc-per-node N tests/trainer/trainer_scenarios.py SUITE OUT_DIR [MORE_DIRS]

Each suite runs several small Trainer jobs one after another inside one process group (a
torchrun launch costs seconds, a Trainer build milliseconds) and leaves what the tests assert
on in OUT_DIR as torch.save files written by rank 0 (and a few per rank). Suites:

- two_ranks: plain SFT run with checkpoints and publishing (losses, gathered bf16 state after
  every publish, each rank's local shards and placements), resume from its middle checkpoint,
  initial weights from an HF-style directory, gradient accumulation, activation checkpointing, GRPO with KL, bf16 mixed precision with CPU
  offload, NaN injection into the guard.
- one_rank: the plain SFT and GRPO runs on one rank (the reference for the 2-rank losses), and
  a resume of the 2-rank job's checkpoint on 1 rank (argument 3: the two_ranks OUT_DIR).
- hsdp: 4 ranks as 2 replicas x 2 shards, with publishing.
- gpu: CUDA/NCCL, bf16 mixed precision with publishing, without and with CPU offload.
- kill / restart: publishing every step; in `kill` rank 1 SIGKILLs itself in the middle of
  publishing step KILL_STEP; `restart` is the same job relaunched, resuming from its checkpoint.
- engine: the TrainingEngine itself, without a loop: one forward_backward + AdamW step (to
  compare with plain torch), and a Training API state in the format saved before extras had
  files of their own, loaded by a fresh engine that then steps exactly as the original.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from weightsync.models import build_model, save_pretrained
from weightsync.trainer.config import ModelSpec, parse_job_config
from weightsync.trainer.pieces import Ownership
from weightsync.trainer.train import Trainer, configure_logging

STEPS = 6
KILL_STEP = 5

BASE = {
    "parallel": {"dp_shard": -1},
    "train": {
        "steps": STEPS,
        "seed": 1,
        "model": {
            "model_type": "qwen3",
            "vocab_size": 259,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "init_seed": 3,
        },
        "optimizer": {"lr": 3e-3, "max_grad_norm": 1.0, "weight_decay": 0.01},
        "schedule": {"warmup_steps": 2, "decay": "cosine"},
        "data": {"source": "arithmetic", "global_batch_size": 8, "micro_batch_size": 4, "max_seq_len": 64},
        "guard": {"enabled": False},
    },
}


def publish_to(store: str) -> dict:
    """[train.publish] for `store`, every step, default publisher settings."""
    return {"store": store, "model": "tiny", "every_steps": 1}


def job(**sections):
    """BASE with `train.<section>` (or `parallel`) tables updated."""
    doc = copy.deepcopy(BASE)
    for name, table in sections.items():
        target = doc["parallel"] if name == "parallel" else doc["train"].setdefault(name, {})
        if isinstance(table, dict):
            target.update(table)
        else:
            doc["train"][name] = table
    return parse_job_config(doc)


class RecordingTrainer(Trainer):
    """Records the gathered bf16 state after every publish (test-only: the loop never gathers)."""

    published_states: dict

    def publish(self):
        metrics = super().publish()
        if self.publisher is not None:
            full = self.full_state_dict()
            if self.rank == 0:
                self.published_states[self.step] = {k: v.to(torch.bfloat16) for k, v in full.items()}
        return metrics


class FaultyTrainer(Trainer):
    """Makes the gradients and loss of chosen forward_backward calls NaN (a corrupt batch)."""

    bad_calls: set[int]
    calls = 0

    def forward_backward(self, micro_batches):
        metrics = super().forward_backward(micro_batches)
        self.calls += 1
        if self.calls in self.bad_calls:
            for p in self.model.parameters():
                p.grad.fill_(float("nan"))
            metrics["loss"] = float("nan")
        return metrics


def run(config, *, cls=Trainer, **attrs):
    trainer = cls(config)
    for name, value in attrs.items():
        setattr(trainer, name, value)
    try:
        history = trainer.train()
        return trainer, history, trainer.full_state_dict()
    finally:
        trainer.close()


def write_jsonl(path: Path) -> None:
    """GRPO examples: arithmetic prompts with right and wrong answers, advantages +-1, and
    sampler log-probs a little off the current policy (as a stale sampler's would be)."""
    from weightsync.trainer.data import ArithmeticSource

    source = ArithmeticSource(dp_rank=0, dp_size=1, seed=5)
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for i, example in enumerate(source.take(32)):
            tokens = example.tokens.tolist()
            if i % 2:  # a wrong answer: perturb one response digit
                j = int(example.loss_weights.nonzero()[0])
                tokens[j] = 48 + (tokens[j] - 48 + 1) % 10
            logprobs = (-5.5 + 0.3 * torch.randn(len(tokens), generator=g)) * example.loss_weights
            f.write(
                json.dumps(
                    {
                        "tokens": tokens,
                        "loss_weights": example.loss_weights.tolist(),
                        "advantage": -1.0 if i % 2 else 1.0,
                        "sampler_logprobs": logprobs.tolist(),
                        "sampler_step": 0,
                    }
                )
                + "\n"
            )


def grpo_job(out: Path, **extra):
    if dist.get_rank() == 0:
        write_jsonl(out / "grpo.jsonl")
    dist.barrier()
    return job(
        data={"source": "jsonl", "path": str(out / "grpo.jsonl")},
        loss={"kind": "grpo", "kl_coef": 0.05},
        guard={"enabled": True, "watch": "loss/nll"},
        **extra,
    )


def suite_one_rank(out: Path, two_ranks_out: Path) -> dict:
    _, plain, _ = run(job())
    _, grpo, _ = run(grpo_job(out))
    # Elastic resume: the 2-rank job's step-3 checkpoint, resharded onto 1 rank by DCP.
    shutil.copytree(two_ranks_out / "ckpt" / "step-00000003", out / "elastic" / "step-00000003")
    _, elastic, _ = run(job(checkpoint={"dir": str(out / "elastic"), "every_steps": 3}))
    return {"plain": plain, "grpo": grpo, "elastic": elastic}


def suite_hsdp(out: Path) -> dict:
    """4 ranks as 2 replicas x 2 shards, publishing: replica 1 publishes nothing of its own."""
    config = job(parallel={"dp_replicate": 2}, data={"micro_batch_size": 2}, publish=publish_to(str(out / "store")))
    trainer, history, state = run(config, cls=RecordingTrainer, published_states={})
    return {"history": history, "state": state, "published_states": trainer.published_states}


def suite_two_ranks(out: Path) -> dict:
    rank = dist.get_rank()
    results = {}
    ckpt, store = out / "ckpt", out / "store"
    config = job(checkpoint={"dir": str(ckpt), "every_steps": 3, "keep_last": 2}, publish=publish_to(str(store)))
    trainer, results["plain"], results["plain_state"] = run(config, cls=RecordingTrainer, published_states={})
    results["published_states"] = trainer.published_states
    # Each rank's own shards and where they go, to reassemble in the test.
    shards, placements = Ownership().collect(trainer.model.state_dict())
    torch.save(
        {"shards": shards, "placements": {k: (p.global_shape, p.start) for k, p in placements.items()}},
        out / f"shards-rank{rank}.pt",
    )

    # Resume: a fresh job directory holding only the step-3 checkpoint.
    resume_dir = out / "resume"
    if rank == 0:
        shutil.copytree(ckpt / "step-00000003", resume_dir / "step-00000003")
    dist.barrier()
    _, results["resumed"], results["resumed_state"] = run(job(checkpoint={"dir": str(resume_dir), "every_steps": 3}))

    # Initial weights from an HF-style directory (config.json + safetensors, fp32 here): the
    # same weights as init_seed 3, so the same first steps as the plain run.
    hf_dir = out / "hf-init"
    base = job(steps=2)
    if rank == 0:
        architecture = base.train.model.architecture
        save_pretrained(hf_dir, architecture, build_model(architecture, seed=3).state_dict(), dtype=None)
    dist.barrier()
    from_dir = dataclasses.replace(base, train=dataclasses.replace(base.train, model=ModelSpec(init_dir=str(hf_dir))))
    _, results["from_hf_dir"], _ = run(from_dir)

    _, results["accum"], _ = run(job(data={"micro_batch_size": 2}))
    _, results["ac"], _ = run(job(parallel={"activation_checkpointing": True}))
    _, results["grpo"], _ = run(grpo_job(out))
    _, results["bf16_offload"], _ = run(
        job(parallel={"mixed_precision": "bf16", "cpu_offload": True, "activation_checkpointing": True})
    )
    # Guard: call 2 is NaN (skipped, training goes on); calls 5-7 are NaN: 5 and 6 are skipped,
    # the third in a row rolls back to the step-4 checkpoint; steps 5-8 then run again.
    guard = {"enabled": True, "action": "rollback", "rollback_after": 3, "min_history": 2}
    _, results["guard"], results["guard_state"] = run(
        job(steps=8, guard=guard, checkpoint={"dir": str(out / "guard-ckpt"), "every_steps": 4}),
        cls=FaultyTrainer,
        bad_calls={2, 5, 6, 7},
    )
    return results


def suite_kill(out: Path) -> dict:
    config = job(
        steps=10, checkpoint={"dir": str(out / "ckpt"), "every_steps": 3}, publish=publish_to(str(out / "store"))
    )

    class KillingTrainer(Trainer):
        def publish(self):
            if self.rank == 1 and self.step == KILL_STEP:
                self.publisher.collect(wait=True)  # earlier versions settle first: kill this one only
                store = self.publisher._publisher.store
                rank0_parts = out / "store" / "models" / "tiny" / "parts" / f"{KILL_STEP:012d}"
                for name in ("put", "put_new"):
                    original = getattr(store, name)

                    def die(key, data, _original=original, _name=name):
                        if _name == "put" and "/parts/" not in key:
                            _original(key, data)  # a chunk of this version lands, then the rank dies
                        # ... once rank 0's part of this version is durable (what the test checks is that
                        # a version with one rank's part and not the other's does not exist). Waiting on
                        # the file, not on time: rank 0 publishes concurrently, and once this rank dies
                        # torchrun stops it, part or not (seen on a loaded CI machine).
                        deadline = time.monotonic() + 300
                        while not list(rank0_parts.glob("*/rank-00000.json")) and time.monotonic() < deadline:
                            time.sleep(0.05)
                        os.kill(os.getpid(), signal.SIGKILL)  # before this rank's part exists

                    setattr(store, name, die)
            return super().publish()

    _, history, _ = run(config, cls=KillingTrainer)
    return {"history": history}  # never reached: rank 1 dies at step KILL_STEP


def suite_restart(out: Path) -> dict:
    config = job(
        steps=10, checkpoint={"dir": str(out / "ckpt"), "every_steps": 3}, publish=publish_to(str(out / "store"))
    )
    trainer, history, state = run(config, cls=RecordingTrainer, published_states={})
    return {"history": history, "state": state, "published_states": trainer.published_states}


def suite_gpu(out: Path) -> dict:
    """CUDA/NCCL: bf16 mixed precision with publishing, then the same with CPU offload."""
    results = {}
    for offload in (False, True):
        torch.cuda.reset_peak_memory_stats()
        config = job(
            parallel={"device": "cuda", "mixed_precision": "bf16", "cpu_offload": offload},
            publish=publish_to(str(out / f"store-{int(offload)}")),
        )
        trainer, history, state = run(config, cls=RecordingTrainer, published_states={})
        results[offload] = {
            "history": history,
            "state": state,
            "published_states": trainer.published_states,
            "peak_cuda_bytes": torch.cuda.max_memory_allocated(),
        }
    return results


def suite_engine(out: Path) -> dict:
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from weightsync.trainer.config import ParallelConfig
    from weightsync.trainer.engine import TrainingEngine
    from weightsync.trainer.losses import LossSums
    from weightsync.trainer.optim import AdamWParams
    from weightsync.trainer.parallel import build_mesh, init_runtime

    runtime = init_runtime(ParallelConfig(device="cpu"))
    parallel = ParallelConfig(device="cpu")
    mesh = build_mesh(parallel, runtime)
    architecture = job().train.model.architecture
    initial = build_model(architecture, seed=3).state_dict() if runtime.rank == 0 else None

    def build():
        return TrainingEngine.build(architecture, initial, mesh=mesh, parallel=parallel, device=runtime.device)

    tokens = torch.randint(0, architecture.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    mine = tokens[runtime.rank :: runtime.world_size]
    adamw = AdamWParams(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)

    def step(engine):
        _, result = engine.forward_backward(
            mine[:, :-1], mine[:, 1:], lambda lp: LossSums(-lp.sum(), {}), divisor=float(tokens[:, 1:].numel())
        )
        norm = engine.clip_gradients(0.0)
        engine.optimizer_step(adamw)
        return norm

    engine = build()
    results = {"architecture": architecture, "tokens": tokens, "adamw": adamw, "initial": initial}
    results["grad_norm"] = step(engine)
    results["after_one"] = engine.full_state_dict()
    # What app/training/worker.py's SaveState wrote before this format: the step count in DCP.
    legacy = out / "legacy-state"
    model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
    dcp_save({"model": model_state, "optim": optim_state, "extra": {"optim_steps": 1}}, checkpoint_id=legacy)
    step(engine)
    results["after_two"] = engine.full_state_dict()
    fresh = build()
    fresh.load(legacy)
    results["legacy_optim_steps"] = fresh.optim_steps
    step(fresh)
    results["legacy_after_two"] = fresh.full_state_dict()
    return results


def main() -> None:
    from weightsync.trainer.config import ParallelConfig
    from weightsync.trainer.parallel import close_runtime, exit_worker, init_runtime

    suite, out, *more = sys.argv[1], Path(sys.argv[2]), *map(Path, sys.argv[3:])
    runtime = init_runtime(ParallelConfig(device="cuda" if suite == "gpu" else "cpu"))
    configure_logging("WARNING")
    results = {
        "one_rank": suite_one_rank,
        "two_ranks": suite_two_ranks,
        "hsdp": suite_hsdp,
        "kill": suite_kill,
        "restart": suite_restart,
        "gpu": suite_gpu,
        "engine": suite_engine,
    }[suite](out, *more)
    if runtime.rank == 0:
        torch.save(results, out / f"{suite}.pt")
    dist.barrier()
    close_runtime(runtime)
    exit_worker(0)  # the gloo group outlives close_runtime (FSDP holds it): see exit_worker


if __name__ == "__main__":
    main()
