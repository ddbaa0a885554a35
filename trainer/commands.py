"""commands: the Training API's requests as collective commands that every rank runs on its engines.

Every rank of a `weightsync serve-training` job holds a `Worker`: its training engines, by model
id. Rank 0 (the one serving HTTP) turns each request into a command and calls
`Commander.run(command)`: the command is broadcast to every rank, then each rank executes it
on its own shards, so the ranks run exactly the same sequence of collectives. The other ranks
sit in `follow()`. Rank 0 checks every request *before* it becomes a command: a command that
reaches the ranks is well-formed, and a bad request changes nothing anywhere. While idle, rank 0
sends a no-op now and then so that the followers' blocking receive never reaches the process
group's timeout.

ForwardBackward splits the datums over the data-parallel ranks (datum i on rank i % ranks),
pads them into one batch per rank, and backpropagates the *sum* of the per-datum losses (the
engine makes the reduced gradient that of the whole batch's sum, as on one rank). Gradients
accumulate across commands until OptimStep.

Not here: HTTP, ordering, futures, checking requests (`weightsync.app.training`); the model,
its optimizer step and checkpoints (engine.py); the loss formulas (losses.py).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from weightsync.model_files import read_model_files
from weightsync.publisher import PublisherConfig
from weightsync.trainer.config import ParallelConfig, PublishConfig
from weightsync.trainer.data import Datum, collate_datums
from weightsync.trainer.engine import TrainingEngine, WeightsKind, read_weights
from weightsync.trainer.lora import LoraSettings
from weightsync.trainer.losses import sum_datum_losses
from weightsync.trainer.optim import AdamWParams
from weightsync.trainer.parallel import Runtime, broadcast_object
from weightsync.trainer.publish import WeightPublisher

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ commands


@dataclasses.dataclass(frozen=True)
class CreateModel:
    model_id: str
    base_dir: str
    lora: LoraSettings | None = None


@dataclasses.dataclass(frozen=True)
class ForwardBackward:
    model_id: str
    loss_fn: str
    loss_config: dict[str, float]
    """Complete: every key the loss takes (losses.LOSSES), defaults filled in."""
    data: list[Datum]
    forward_only: bool


@dataclasses.dataclass(frozen=True)
class OptimStep:
    model_id: str
    params: AdamWParams
    grad_clip_norm: float
    """Clip the global gradient norm to this first; 0 = no clipping."""


@dataclasses.dataclass(frozen=True)
class SaveState:
    model_id: str
    directory: str


@dataclasses.dataclass(frozen=True)
class LoadState:
    model_id: str
    directory: str
    with_optimizer: bool


@dataclasses.dataclass(frozen=True)
class PublishWeights:
    """Publish the model's current weights as the next version of `store_model` (every rank
    its own shards; the version commits once all are durable); rank 0 returns the version."""

    model_id: str
    store: str
    store_model: str
    push: tuple[str, ...] = ()
    kind: WeightsKind = "full"
    """"full" (the model as trained), "merged" (LoRA folded into the base weights, the plain
    model's names) or "adapter" (only the LoRA tensors)."""


@dataclasses.dataclass(frozen=True)
class Unload:
    model_id: str


@dataclasses.dataclass(frozen=True)
class Ping:
    """Keeps the followers' receive from timing out."""


@dataclasses.dataclass(frozen=True)
class Stop:
    """Followers leave follow()."""


# ------------------------------------------------------------------------------ the engines


@dataclasses.dataclass
class LoadedModel:
    engine: TrainingEngine
    base_dir: str
    """The HF directory it was created from: its config and tokenizer files travel with every
    version published of it (weightsync.model_files)."""
    publishers: dict[str, WeightPublisher] = dataclasses.field(default_factory=dict)  # by store model


class Worker:
    """This rank's engines. `execute` is collective: every rank calls it with the same command."""

    def __init__(self, runtime: Runtime, mesh: DeviceMesh, parallel: ParallelConfig) -> None:
        self.runtime, self.mesh, self.parallel = runtime, mesh, parallel
        self.world_size = runtime.world_size
        self.models: dict[str, LoadedModel] = {}

    def execute(self, command: Any) -> Any:
        handler = getattr(self, "_" + type(command).__name__)
        return handler(command)

    def _Ping(self, command: Ping) -> None:
        return None

    def _Stop(self, command: Stop) -> None:
        for model_id in list(self.models):
            self._Unload(Unload(model_id))

    def _CreateModel(self, command: CreateModel) -> dict[str, Any]:
        config, weights = read_weights(command.base_dir, rank=self.runtime.rank)
        engine = TrainingEngine.build(
            config, weights, mesh=self.mesh, parallel=self.parallel, device=self.runtime.device, lora=command.lora
        )
        del weights
        self.models[command.model_id] = LoadedModel(engine, command.base_dir)
        return {
            "vocab_size": config.vocab_size,
            "model_type": config.model_type,
            "trainable_parameters": engine.trainable_parameters,
        }

    def _Unload(self, command: Unload) -> None:
        loaded = self.models.pop(command.model_id, None)
        for publisher in loaded.publishers.values() if loaded is not None else ():
            publisher.close()
        del loaded
        gc.collect()  # the sharded modules hold reference cycles: free their memory now
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _ForwardBackward(self, command: ForwardBackward) -> tuple[list[dict[str, np.ndarray]], dict[str, float]] | None:
        engine = self.models[command.model_id].engine
        mine = list(range(engine.dp_rank, len(command.data), engine.dp_size))
        batch = collate_datums([command.data[i] for i in mine], engine.device)
        logprobs, result = engine.forward_backward(
            batch.input_ids,
            batch.targets,
            lambda lp: sum_datum_losses(command.loss_fn, command.loss_config, lp, batch),
            backward=not command.forward_only,
            token_mask=batch.token_mask,
        )
        outputs = [
            (
                i,
                {
                    "logprobs": logprobs[row, :length].float().cpu().numpy(),
                    "elementwise_loss": result.per_token[row].float().cpu().numpy(),
                },
            )
            for row, (i, length) in enumerate(zip(mine, batch.lengths, strict=True))
        ]
        aux = result.metrics.get("moe/aux_loss")  # this rank's share (MoE models that train)
        sums = torch.stack([result.loss.detach(), aux if aux is not None else torch.zeros_like(result.loss)])
        sums = sums.double().cpu()
        if engine.tp_rank != 0:  # tensor-parallel ranks of one dp rank ran the same datums: one reports them
            outputs, sums = [], torch.zeros_like(sums)
        if self.world_size > 1:
            dist.all_reduce(sums)
        gathered = self._gather(outputs)
        if gathered is None:
            return None
        ordered = [out for _, out in sorted(gathered, key=lambda pair: pair[0])]
        metrics = {"loss:sum": float(sums[0])}
        if aux is not None:  # the SDK folds chunked calls by the name's suffix: a mean over calls
            metrics["moe/aux_loss:mean"] = float(sums[1])
        return ordered, metrics

    def _gather(self, items: list) -> list | None:
        """Every rank's list, concatenated on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return items
        box: list[Any] = [None] * self.world_size if self.runtime.rank == 0 else None
        dist.gather_object(items, box, dst=0)
        return None if box is None else [x for part in box for x in part]

    def _OptimStep(self, command: OptimStep) -> dict[str, float]:
        engine = self.models[command.model_id].engine
        norm = engine.clip_gradients(command.grad_clip_norm)
        engine.optimizer_step(command.params)
        return {"grad_norm": norm, "optim_steps": float(engine.optim_steps)}

    def _SaveState(self, command: SaveState) -> None:
        self.models[command.model_id].engine.save(command.directory)

    def _LoadState(self, command: LoadState) -> None:
        self.models[command.model_id].engine.load(command.directory, with_optimizer=command.with_optimizer)

    def _PublishWeights(self, command: PublishWeights) -> dict[str, Any]:
        loaded = self.models[command.model_id]
        publisher = loaded.publishers.get(command.store_model)
        if publisher is None:
            config = PublishConfig(
                store=command.store,
                model=command.store_model,
                push=command.push,
                publisher=PublisherConfig(
                    workers=2, max_in_flight=1, weights_kind="adapter" if command.kind == "adapter" else "model"
                ),
            )
            # Whole weights carry the base model's files, so the store alone is enough to serve them;
            # adapter-only versions are served on a base model the engine already has.
            files = read_model_files(loaded.base_dir) if command.kind != "adapter" else None
            publisher = WeightPublisher(config, rank=self.runtime.rank, world_size=self.world_size, model_files=files)
            loaded.publishers[command.store_model] = publisher
        failures = publisher.failures
        # Adapters alone compute nothing: their versions carry no probe (the merged ones do).
        probe = publisher.probe(loaded.engine, kind=command.kind) if command.kind != "adapter" else None
        publisher.publish(loaded.engine.weights(command.kind), loaded.engine.optim_steps, probe=probe)
        metrics = publisher.collect(wait=True)
        if publisher.failures != failures:
            raise RuntimeError(
                f"publishing {command.store_model} to {command.store} failed (see the server log); "
                "the next save_weights_for_sampler publishes a full version"
            )
        return {"version": publisher.last_version, "ratio": metrics.get("publish/ratio")}


# ------------------------------------------------------------------------------ rank 0 -> all


class Commander:
    """Rank 0's side: runs a command on every rank, one at a time; pings idle followers."""

    def __init__(self, worker: Worker, *, keepalive_s: float = 60.0) -> None:
        self.worker = worker
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = threading.Event()
        if worker.world_size > 1:
            threading.Thread(target=self._keepalive, args=(keepalive_s,), name="rank-keepalive", daemon=True).start()

    def run(self, command: Any) -> Any:
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the training workers have been stopped")
            return self._run_locked(command)

    def _run_locked(self, command: Any) -> Any:
        if self.worker.world_size > 1:
            broadcast_object(command)
        try:
            return self.worker.execute(command)
        finally:
            self._last = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            if self.worker.world_size > 1:
                self._run_locked(Stop())

    def _keepalive(self, every_s: float) -> None:
        while not self._closed.wait(every_s / 4):
            with self._lock:
                if not self._closed.is_set() and time.monotonic() - self._last > every_s:
                    self._run_locked(Ping())


def follow(worker: Worker) -> None:
    """The other ranks: execute rank 0's commands until Stop."""
    while True:
        command = broadcast_object()
        if isinstance(command, Stop):
            return
        try:
            worker.execute(command)
        except Exception:  # rank 0 fails the request; this rank stays in step for the next command
            log.exception("command %s failed on this rank", type(command).__name__)
