"""train: the TOML training loop on the training engine, with checkpoints, the spike guard and
publishing in it.

    torchrun --standalone --nproc-per-node 2 -m weightsync.trainer.train --config FILE [--set k=v ...]

`Trainer` is built once (process group, mesh, the training engine and, for a KL term, a frozen
reference engine, data, guard, checkpoints, publisher; resuming from the newest checkpoint if
there is one), then `train()` runs the loop, one line per concern, and `close()` waits for
versions still in flight. What the loop adds to the engine: micro-batches and the loss scale,
the LR schedule, the guard's verdict with rollback, RNG and data position in checkpoints, when
to publish and save, metrics.

A step: the global batch (global_batch_size examples over all data-parallel ranks) is cut
into micro-batches per rank; gradients accumulate over them and are reduce-scattered only
after the last. Losses are sums over weighted tokens divided by the weight of the whole global
batch (one scalar all-reduce before the forward passes), so 1 rank and N ranks, 1 and k
micro-batches, compute the same objective (an MoE model adds its router's load-balancing
loss, a mean over the global batch's real tokens, logged as "moe/aux_loss": see
TrainingEngine.forward_backward). Then: one all-reduce of the metric sums, gradient clipping
(global norm), the guard's verdict, the optimizer step (or not), publish, checkpoint, and one
JSON metrics line on rank 0.

Not here: the model, forward/backward, the optimizer step and DCP save/load (engine.py), how
shards are published (publish.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from weightsync import logs
from weightsync.errors import ConfigError
from weightsync.models import CausalLM, ModelConfig, build_model
from weightsync.trainer.checkpoint import CheckpointManager
from weightsync.trainer.config import JobConfig, ModelSpec, load_job_config
from weightsync.trainer.data import ExampleSource, MicroBatch, build_source, collate
from weightsync.trainer.engine import TrainingEngine, read_weights
from weightsync.trainer.guard import SpikeGuard, Verdict
from weightsync.trainer.losses import compute_loss
from weightsync.trainer.optim import AdamWParams, lr_at
from weightsync.trainer.parallel import build_mesh, close_runtime, dp_rank_and_size, exit_worker, init_runtime
from weightsync.trainer.publish import WeightPublisher, model_files_of

log = logging.getLogger(__name__)


def load_initial_weights(spec: ModelSpec, *, rank: int) -> tuple[ModelConfig, dict[str, torch.Tensor] | None]:
    """The architecture (every rank) and the fp32 initial weights (rank 0 only; None elsewhere)."""
    if spec.init_dir is not None:
        return read_weights(spec.init_dir, rank=rank)
    if rank != 0:
        return spec.architecture, None
    return spec.architecture, build_model(spec.architecture, seed=spec.init_seed).state_dict()


def _real_tokens(mb: MicroBatch) -> int:
    """Positions that are not padding (every position of a batch collated without a mask)."""
    return mb.num_tokens if mb.token_mask is None else int(mb.token_mask.sum())


class Trainer:
    """One training job on this rank. Every method is collective: all ranks call it together."""

    def __init__(self, job: JobConfig, *, source: ExampleSource | None = None) -> None:
        self.job, self.config = job, job.train
        self.runtime = init_runtime(job.parallel)
        self.rank, self.device = self.runtime.rank, self.runtime.device
        self.mesh = build_mesh(job.parallel, self.runtime)
        self.dp_rank, self.dp_size = dp_rank_and_size(self.mesh)
        self.grad_accum_steps = self.config.data.grad_accum_steps(self.dp_size)
        architecture, initial = load_initial_weights(self.config.model, rank=self.rank)
        build = {"mesh": self.mesh, "parallel": job.parallel, "device": self.device}
        self.engine = TrainingEngine.build(architecture, initial, **build)
        # The KL reference is the initial policy, frozen (rebuilt identically on resume).
        self.reference = (
            TrainingEngine.build(architecture, initial, trainable=False, **build) if self.config.loss.kl_coef else None
        )
        del initial
        self.source = source or build_source(self.config.data, dp_rank=self.dp_rank, dp_size=self.dp_size)
        self.guard = SpikeGuard(self.config.guard)
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self._seed_rngs()
        self.checkpoints = None
        if self.config.checkpoint.dir is not None:
            self.checkpoints = CheckpointManager(self.config.checkpoint, rank=self.rank)
            self.checkpoints.remove_incomplete()
            if self.config.checkpoint.resume:
                self._resume()
        self.publisher = None
        if self.config.publish.store is not None:
            self.publisher = WeightPublisher(
                self.config.publish,
                rank=self.rank,
                world_size=self.runtime.world_size,
                model_files=model_files_of(self.config.model, architecture, self.config.publish),
            )
        log.info(
            "trainer ready: %s, %d ranks (mesh %s), %d micro-batch(es) of %d per rank per step, step %d/%d",
            architecture.model_type,
            self.runtime.world_size,
            tuple(self.mesh.shape),
            self.grad_accum_steps,
            self.config.data.micro_batch_size,
            self.step,
            self.config.steps,
        )

    @property
    def model(self) -> CausalLM:
        """The sharded model being trained (the engine's)."""
        return self.engine.model

    # ----------------------------------------------------------------------------- the loop

    def train(self) -> list[dict[str, Any]]:
        """Runs to train.steps; returns the metrics of every step this call ran."""
        while self.step < self.config.steps:
            t0 = time.perf_counter()
            micro_batches = self.next_micro_batches()
            metrics = self.forward_backward(micro_batches)
            metrics.update(self.clip_gradients())
            verdict = self.apply_verdict(metrics)
            metrics.update(self.publish())
            self.maybe_save_checkpoint(verdict)
            self.log_metrics(metrics, verdict, t0)
        return self.history

    def next_micro_batches(self) -> list[MicroBatch]:
        size, data = self.config.data.micro_batch_size, self.config.data
        return [
            collate(self.source.take(size), max_seq_len=data.max_seq_len, pad_multiple=data.pad_multiple)
            for _ in range(self.grad_accum_steps)
        ]

    def forward_backward(self, micro_batches: list[MicroBatch]) -> dict[str, Any]:
        """Accumulates gradients of the global-token-mean loss; returns the reduced metrics."""
        # One all-reduce: the loss weight of the whole global batch, and its real tokens (an MoE
        # router's load-balancing loss is a mean over them; engine.forward_backward).
        totals = torch.stack(
            [
                torch.stack([mb.loss_weights.sum() for mb in micro_batches]).sum(),
                torch.tensor(float(sum(_real_tokens(mb) for mb in micro_batches))),
            ]
        ).to(self.device)
        dist.all_reduce(totals, group=self.engine.dp_group)  # tensor-parallel ranks share a batch: once per dp rank
        global_weight, step_tokens = totals[0], totals[1]
        # Each micro-batch's loss sum over the weight of the whole global batch: the accumulated
        # gradient is that of the global token mean, reduced across ranks after the last one.
        divisor = global_weight.clamp_min(torch.finfo(torch.float32).tiny)
        sums: dict[str, torch.Tensor] = {}
        last = len(micro_batches) - 1
        for i, mb in enumerate(micro_batches):
            mb = mb.to(self.device)
            _, result = self.engine.forward_backward(
                mb.input_ids,
                mb.targets,
                lambda logprobs, mb=mb: compute_loss(self.config.loss, logprobs, mb, self.reference_logprobs(mb)),
                divisor=divisor,
                sync_gradients=i == last,
                token_mask=mb.token_mask,
                step_tokens=step_tokens,
            )
            for name, value in {"loss": result.loss.detach(), **result.metrics}.items():
                sums[name] = sums.get(name, 0.0) + value
        return self.reduce_metrics(sums, global_weight, micro_batches)

    def reference_logprobs(self, mb: MicroBatch) -> torch.Tensor | None:
        return None if self.reference is None else self.reference.logprobs(mb.input_ids, mb.targets)

    def reduce_metrics(
        self, sums: dict[str, torch.Tensor], global_weight: torch.Tensor, micro_batches: list[MicroBatch]
    ) -> dict[str, Any]:
        """One all-reduce of every sum; token metrics are divided by the global weight."""
        names = sorted(sums)
        sampler_steps = torch.cat([mb.sampler_steps for mb in micro_batches])
        known = sampler_steps[sampler_steps >= 0]
        extra = [sum(mb.num_tokens for mb in micro_batches), known.numel(), float((self.step + 1 - known).sum())]
        packed = torch.stack([sums[n].float().to(self.device) for n in names])
        packed = torch.cat([packed, torch.tensor(extra, dtype=torch.float32, device=self.device)])
        dist.all_reduce(packed, group=self.engine.dp_group)
        values = packed.tolist()
        weight = max(float(global_weight), torch.finfo(torch.float32).tiny)
        metrics: dict[str, Any] = {name: values[i] / weight for i, name in enumerate(names)}
        tokens, sampled, staleness = values[len(names) :]
        metrics.update({"tokens": int(tokens), "loss_tokens": float(global_weight)})
        if sampled:
            metrics["data/staleness_steps"] = staleness / sampled
        return metrics

    def clip_gradients(self) -> dict[str, float]:
        return {"grad_norm": self.engine.clip_gradients(self.config.optimizer.max_grad_norm)}

    def apply_verdict(self, metrics: dict[str, Any]) -> Verdict:
        """The optimizer step the guard allows: step, skip (drop the gradients) or roll back."""
        decision = self.guard.judge(metrics)
        self.step += 1
        if decision.verdict is Verdict.ACCEPT:
            lr = lr_at(
                self.step,
                peak_lr=self.config.optimizer.lr,
                schedule=self.config.schedule,
                total_steps=self.config.steps,
            )
            self.engine.optimizer_step(AdamWParams.from_config(self.config.optimizer, lr=lr))
            metrics["lr"] = lr
        else:
            log.warning("step %d: %s -> %s", self.step, decision.reason, decision.verdict.value)
            self.engine.discard_gradients()
        if decision.verdict is Verdict.ROLLBACK:
            self.rollback()
        return decision.verdict

    def publish(self) -> dict[str, float]:
        if self.publisher is None:
            return {}
        metrics: dict[str, float] = {}
        if self.publisher.due(self.step, self.config.steps):
            t0 = time.perf_counter()
            probe = self.publisher.probe(self.engine)
            metrics["publish/probe_s"] = time.perf_counter() - t0
            metrics.update(self.publisher.publish(self.engine.weights(), self.step, probe=probe))
        metrics.update(self.publisher.collect())
        return metrics

    def maybe_save_checkpoint(self, verdict: Verdict) -> None:
        every = self.config.checkpoint.every_steps
        if self.checkpoints is None or verdict is Verdict.ROLLBACK:  # the newest one was just loaded
            return
        if self.step % every == 0 or self.step == self.config.steps:
            self.save_checkpoint()

    def log_metrics(self, metrics: dict[str, Any], verdict: Verdict, t0: float) -> None:
        elapsed = time.perf_counter() - t0
        metrics.update(step=self.step, verdict=verdict.value, step_s=elapsed, tokens_per_s=metrics["tokens"] / elapsed)
        self.history.append(metrics)
        if self.rank != 0:
            return
        # Strict JSON has no NaN/Infinity: write them as strings so any JSON reader takes the line.
        line = json.dumps(
            {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()},
            sort_keys=True,
        )
        if self.step % self.config.log_every == 0 or self.step == self.config.steps:
            print(line, flush=True)
        if self.config.metrics_path:
            with open(self.config.metrics_path, "a") as f:
                f.write(line + "\n")

    # ---------------------------------------------------------------- checkpoints, rollback

    def save_checkpoint(self) -> None:
        extra = {
            "step": self.step,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
            "rng_python": random.getstate(),
            "data": self.source.state_dict(),
            "guard": self.guard.state_dict(),
        }
        self.engine.save(self.checkpoints.path(self.step), extra)
        self.checkpoints.prune()

    def _resume(self) -> None:
        latest = self.checkpoints.latest()
        if latest is None:
            return
        extra = self.engine.load(latest[1])
        self.step = int(extra["step"])
        log.info("resumed from %s (step %d)", latest[1], self.step)
        if extra["own_rank"]:  # another rank's RNG streams would duplicate that rank's
            torch.set_rng_state(extra["rng_cpu"])
            if extra["rng_cuda"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(extra["rng_cuda"], self.device)
            random.setstate(extra["rng_python"])
        self.source.load_state_dict(extra["data"])
        self.guard.load_state_dict(extra["guard"])

    def rollback(self) -> None:
        """Restores model and optimizer (and the step number) from the newest checkpoint. The
        data position is kept: the batches that went bad are not replayed."""
        latest = self.checkpoints.latest() if self.checkpoints is not None else None
        if latest is None:
            log.error("rollback wanted at step %d but there is no checkpoint; skipping the step instead", self.step)
            self.guard.reset_streak()
            return
        bad_step = self.step
        extra = self.engine.load(latest[1])
        self.step = int(extra["step"])
        self.guard.load_state_dict(extra["guard"])
        self.guard.reset_streak()
        log.warning(
            "rolled back from step %d to the checkpoint of step %d (%s); data goes on from where it was",
            bad_step,
            self.step,
            latest[1],
        )

    def _seed_rngs(self) -> None:
        seed = self.config.seed + self.rank
        torch.manual_seed(seed)
        random.seed(seed)

    # --------------------------------------------------------------------------- utilities

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The gathered fp32 state dict on rank 0 ({} elsewhere). For tests and exports: the
        loop itself never gathers."""
        return self.engine.full_state_dict()

    def close(self) -> None:
        """Waits for versions in flight, then leaves the process group if it created it."""
        if self.publisher is not None:
            self.publisher.close()
            log.info(
                "publisher closed: last version %s, %d failed", self.publisher.last_version, self.publisher.failures
            )
            self.publisher = None
        close_runtime(self.runtime)


def configure_logging(level: str = "INFO") -> None:
    """One format for every rank (text, or JSON lines with WEIGHTSYNC_LOG_FORMAT=json, which
    `weightsync train --log-format json` sets); each line says which rank wrote it."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    logs.configure_logging(level, rank=rank)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m weightsync.trainer.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="trainer TOML file (see trainer/configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value, e.g. --set train.steps=10 (repeatable)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        job = load_job_config(args.config, args.overrides)
    except ConfigError as e:  # a setting to fix: one line, exit 2 (not a traceback per rank)
        print(f"weightsync: error: {e}", file=sys.stderr)
        return 2
    trainer = Trainer(job)
    # What setup made (modules, the model, the optimizer, compiled kernels) lives as long as the
    # process: frozen, the collector's full passes no longer walk it, so one that a step's
    # allocations trigger does not stall the step or the publish (the agent does the same).
    gc.freeze()
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    exit_worker(main())  # an exception still ends the process the usual way, with its traceback
