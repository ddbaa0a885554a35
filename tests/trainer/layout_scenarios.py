"""Scenarios of tests/trainer/test_parallel_trainer.py, run under torchrun on 4 ranks (not a test module).

    torchrun --standalone --nproc-per-node 4 tests/trainer/layout_scenarios.py OUT_DIR

One launch runs every job one after another in one process group (a launch costs seconds on a
loaded 2-core machine, a Trainer build far less) and leaves what the tests assert on in OUT_DIR:
`layouts.pt` from rank 0, and `rank-<r>.json` with what each rank handed the publisher.

- dense: the tiny dense model, 20 steps, as dp_shard 4 (FSDP only: the reference) and as
  dp_shard 2 x tp 2, which publishes every step (the gathered bf16 state recorded after each
  publish), checkpoints at step 10 and is resumed from it to step 20;
- moe: the tiny Qwen3-MoE the same way, dp_shard 4 against dp_shard 2 x ep 2;
- lora: 4 LoRA steps of each parallel layout against its FSDP-only run, and the merged weights;
- pieces: every rank's local tensors against the global ones at the indices its boxes name;
- pipeline: a hand-built two-stage split of plain tensors (stage 0 on ranks 0-1, stage 1 on
  ranks 2-3), published through the trainer's publisher (the ownership exchange decides who
  publishes what).
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from trainer_scenarios import BASE as TRAINER_BASE  # beside this file: torchrun puts its folder on sys.path
from trainer_scenarios import RecordingTrainer as GatheringTrainer

from weightsync.models import build_model
from weightsync.trainer.config import ParallelConfig, PublishConfig, parse_job_config
from weightsync.trainer.engine import TrainingEngine
from weightsync.trainer.lora import LoraSettings
from weightsync.trainer.parallel import close_runtime, exit_worker, init_runtime
from weightsync.trainer.pieces import local_indices, placement_of
from weightsync.trainer.publish import WeightPublisher
from weightsync.trainer.train import Trainer, configure_logging

STEPS = 20
RESUME_AT = 10
LORA_STEPS = 4
LORA = LoraSettings(rank=4, seed=1)

DENSE = TRAINER_BASE["train"]["model"]  # vocab 259: uneven over tp 2, then dp 2 (65, 65, 65, 64 rows)
MOE = {
    **DENSE,
    "model_type": "qwen3_moe",
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "mlp_only_layers": [1],
    "router_aux_loss_coef": 0.01,
}
BASE = copy.deepcopy(TRAINER_BASE)  # the 2-rank suite's optimizer, schedule and data, on 4 ranks:
BASE["parallel"]["device"] = "cpu"
BASE["train"]["log_every"] = 100
# 8 examples a step: one micro-batch of 2 on each of 4 dp ranks, or two on each of 2.
BASE["train"]["data"]["micro_batch_size"] = 2


def job(model: dict, parallel: dict, out: Path | None = None, *, steps: int = STEPS, resume: bool = False):
    doc = copy.deepcopy(BASE)
    doc["parallel"].update(parallel)
    doc["train"]["model"] = dict(model)
    doc["train"]["steps"] = steps
    if out is not None:
        doc["train"]["checkpoint"] = {"dir": str(out / "ckpt"), "every_steps": RESUME_AT, "keep_last": 2}
        doc["train"]["checkpoint"]["resume"] = resume
        doc["train"]["publish"] = {"store": str(out / "store"), "model": "tiny", "every_steps": 1}
    return parse_job_config(doc)


class RecordingTrainer(GatheringTrainer):
    """Also records the raw bytes this rank handed the publisher for each version."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.published_states = {}
        self.handed_bytes: list[int] = []
        if self.publisher is not None:
            publish = self.publisher._publisher.publish

            def recording(tensors, **kw):
                self.handed_bytes.append(sum(t.numel() * 2 for t in tensors.values()))  # cast to bf16
                return publish(tensors, **kw)

            self.publisher._publisher.publish = recording


def run(config):
    trainer = Trainer(config)
    try:
        history = trainer.train()
        return trainer, [m["loss"] for m in history], trainer.full_state_dict()
    finally:
        trainer.close()


def losses_of(history):
    return [m["loss"] for m in history]


def piece_mismatches(engine: TrainingEngine, full: dict) -> dict:
    """Local tensors that differ from the global ones at their indices, and the forms used."""
    bad, forms = [], set()
    for name, tensor in engine.model.state_dict().items():
        if not isinstance(tensor, DTensor):
            continue
        indices = local_indices(tensor)
        want = full[name][torch.meshgrid(*indices, indexing="ij")] if indices else full[name]
        if not torch.equal(tensor.to_local(), want):
            bad.append(name)
        forms.add("boxes" if placement_of(tensor).boxes is not None else "flat")
        forms.update(type(p).__name__ for p in tensor.placements)
    return {"bad": bad, "forms": sorted(forms)}


def run_parallel(out: Path, name: str, model: dict, parallel: dict, results: dict, per_rank: dict) -> None:
    """The FSDP-only reference, then the parallel layout with publishing, its resume, and its pieces."""
    results[f"{name}_architecture"] = {k: v for k, v in model.items() if k != "init_seed"}
    _, results[f"{name}_fsdp"], _ = run(job(model, {}))
    where = out / name
    trainer = RecordingTrainer(job(model, parallel, where))
    try:
        initial = build_model(trainer.job.train.model.architecture, seed=model["init_seed"]).state_dict()
        results[f"{name}_pieces"] = piece_mismatches(trainer.engine, initial)
        held = {n.split(".experts.")[1].split(".")[0] for n in trainer.engine.model.state_dict() if ".experts." in n}
        results[f"{name}_experts_on_rank_0"] = sorted(map(int, held))
        history = trainer.train()
        results[name] = losses_of(history)
        results[f"{name}_grad_norms"] = [m["grad_norm"] for m in history]
        results[f"{name}_states"] = trainer.published_states
        results[f"{name}_final"] = trainer.full_state_dict()
        per_rank[name] = trainer.handed_bytes
    finally:
        trainer.close()
    # Resume: the step-10 checkpoint only, run again to step 20 (no publishing: another store).
    resumed = where / "resumed"
    if dist.get_rank() == 0:
        (resumed / "ckpt").mkdir(parents=True)
        shutil.copytree(where / "ckpt" / f"step-{RESUME_AT:08d}", resumed / "ckpt" / f"step-{RESUME_AT:08d}")
    dist.barrier()
    _, resumed_losses, final = run(job(model, parallel, resumed, resume=True))
    results[f"{name}_resumed"] = resumed_losses
    results[f"{name}_resumed_final"] = final


def run_lora(name: str, model: dict, parallel: dict, results: dict) -> None:
    """LoRA on the parallel layout and on FSDP alone (the TOML loop has no LoRA section: a LoRA
    engine of the same weights swapped in, test-only), and the merged weights."""
    for layout, table in (("fsdp", {}), ("parallel", parallel)):

        def lora_engine(trainer):
            spec = trainer.job.train.model
            initial = build_model(spec.architecture, seed=spec.init_seed).state_dict() if trainer.rank == 0 else None
            return TrainingEngine.build(
                spec.architecture,
                initial,
                mesh=trainer.mesh,
                parallel=trainer.job.parallel,
                device=trainer.device,
                lora=LORA,
            )

        trainer = Trainer(job(model, table, steps=LORA_STEPS))
        trainer.engine = lora_engine(trainer)
        try:
            results[f"{name}_lora_{layout}"] = losses_of(trainer.train())
            engine = trainer.engine
            merged = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in engine.weights("merged").items()}
            full = engine.full_state_dict()
            if trainer.rank == 0:
                results[f"{name}_lora_{layout}_merged"] = merged
                results[f"{name}_lora_{layout}_full"] = full
                results[f"{name}_lora_{layout}_targets"] = engine.lora_targets
        finally:
            trainer.close()


def run_pipeline(out: Path, results: dict) -> None:
    """Two pipeline stages of plain tensors; each stage's two ranks hold its tensors whole."""
    rank = dist.get_rank()
    full = build_model(job(DENSE, {}).train.model.architecture, seed=7).state_dict()
    first = [n for n in full if n.startswith(("model.embed_tokens", "model.layers.0."))]
    stage = first if rank < 2 else [n for n in full if n not in first]
    publisher = WeightPublisher(
        PublishConfig(store=str(out / "pipeline"), model="pipeline"), rank=rank, world_size=dist.get_world_size()
    )
    try:
        publisher.publish({n: full[n] for n in stage}, 1)
        publisher.collect(wait=True)
    finally:
        publisher.close()
    results["pipeline_full"] = {k: v.to(torch.bfloat16) for k, v in full.items()}
    results["pipeline_failures"] = publisher.failures


def main() -> None:
    out = Path(sys.argv[1])
    runtime = init_runtime(ParallelConfig(device="cpu"))  # one process group for every job
    configure_logging("WARNING")
    results: dict = {}
    per_rank: dict = {}
    run_parallel(out, "tp", DENSE, {"dp_shard": 2, "tp": 2}, results, per_rank)
    run_parallel(out, "ep", MOE, {"dp_shard": 2, "ep": 2}, results, per_rank)
    run_lora("tp", DENSE, {"dp_shard": 2, "tp": 2}, results)
    run_lora("ep", MOE, {"dp_shard": 2, "ep": 2}, results)
    run_pipeline(out, results)
    rank = dist.get_rank()
    (out / f"rank-{rank}.json").write_text(json.dumps(per_rank))
    if rank == 0:
        torch.save(results, out / "layouts.pt")
    dist.barrier()
    close_runtime(runtime)
    exit_worker(0)  # the gloo group outlives destroy_process_group (FSDP holds it): see exit_worker


if __name__ == "__main__":
    main()
