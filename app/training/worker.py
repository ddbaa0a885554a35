"""worker: the sharded models on one rank, and the collective commands rank 0 sends them.

Every rank of the torchrun job holds a `Worker`. Rank 0 (the one serving HTTP) turns each
request into a `Command` and calls `Commander.run(command)`: the command is broadcast to every
rank (`broadcast_object_list`), then each rank executes it on its own shards, so the ranks run
exactly the same sequence of collectives. The other ranks sit in `follow()`. Rank 0 validates
every request *before* broadcasting it: a command that reaches the ranks is well-formed, and a
bad request changes nothing anywhere. While idle, rank 0 sends a no-op now and then so that the
followers' blocking receive never reaches the process group's timeout.

forward_backward splits the datums over the data-parallel ranks (datum i on rank i % world),
pads them into one batch per rank, and backpropagates the *sum* of the per-datum losses:
FSDP averages gradients over ranks, so each rank scales its sum by the world size and the
reduced gradient is the gradient of the whole batch's sum, as on one rank. Gradients
accumulate across calls until optim_step (AdamW with that call's hyper-parameters).

Not here: HTTP, ordering, futures (service.py); the loss formulas (losses.py).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from weightsync.app.training import lora
from weightsync.app.training.lora import LoraSettings
from weightsync.app.training.losses import loss_spec, resolve_config
from weightsync.app.training.wire import Datum
from weightsync.models import CausalLM, ModelConfig, load_config, load_pretrained, token_logprobs
from weightsync.trainer.config import ParallelConfig
from weightsync.trainer.parallel import (
    Runtime,
    apply_activation_checkpointing,
    apply_fsdp,
    build_sharded_model,
    reset_rope_buffer,
)

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
    data: list[Datum]
    forward_only: bool


@dataclasses.dataclass(frozen=True)
class OptimStep:
    model_id: str
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float


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
    kind: str = "full"
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


# ------------------------------------------------------------------------------ the models


@dataclasses.dataclass
class TrainedModel:
    config: ModelConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    optim_steps: int = 0
    lora: LoraSettings | None = None
    lora_targets: list[str] = dataclasses.field(default_factory=list)
    publishers: dict[str, Any] = dataclasses.field(default_factory=dict)  # store model -> WeightPublisher


class Worker:
    """This rank's models. `execute` is collective: every rank calls it with the same command."""

    def __init__(self, runtime: Runtime, mesh: Any, parallel: ParallelConfig) -> None:
        self.runtime, self.mesh, self.parallel = runtime, mesh, parallel
        self.world_size = runtime.world_size
        self.models: dict[str, TrainedModel] = {}

    def execute(self, command: Any) -> Any:
        handler = getattr(self, "_" + type(command).__name__)
        return handler(command)

    def _Ping(self, command: Ping) -> None:
        return None

    def _Stop(self, command: Stop) -> None:
        for model_id in list(self.models):
            self._Unload(Unload(model_id))

    def _CreateModel(self, command: CreateModel) -> dict[str, Any]:
        if self.runtime.rank == 0:
            config, weights = load_pretrained(command.base_dir, dtype=torch.float32)
        else:
            config, weights = load_config(command.base_dir), None
        targets: list[str] = []
        if command.lora is None:
            model = build_sharded_model(
                config, weights, mesh=self.mesh, config=self.parallel, device=self.runtime.device
            )
        else:
            model, targets = self._build_lora_model(config, weights, command.lora)
        del weights
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=0.0, foreach=True)
        self.models[command.model_id] = TrainedModel(config, model, optimizer, lora=command.lora, lora_targets=targets)
        return {
            "vocab_size": config.vocab_size,
            "model_type": config.model_type,
            "trainable_parameters": sum(p.numel() for p in params),
        }

    def _build_lora_model(self, config: ModelConfig, weights: dict | None, settings: LoraSettings):
        """build_sharded_model's steps, with adapters attached before sharding and initialised
        (from the LoRA seed, on rank 0) with the base weights."""
        with torch.device("meta"):
            model = CausalLM(config)
        targets = lora.attach(model, settings)
        if self.parallel.activation_checkpointing:
            apply_activation_checkpointing(model)
        apply_fsdp(model, self.mesh, self.parallel, device=self.runtime.device)
        model.to_empty(device="cpu" if self.parallel.cpu_offload else self.runtime.device)
        reset_rope_buffer(model)
        state: dict[str, torch.Tensor] = {}
        if weights is not None:
            shapes = {name: tuple(t.shape) for name, t in weights.items()}
            state = {**weights, **lora.initial_adapters(shapes, targets, settings)}
        set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return model, targets

    def _Unload(self, command: Unload) -> None:
        trained = self.models.pop(command.model_id, None)
        for publisher in trained.publishers.values() if trained is not None else ():
            publisher.close()
        del trained
        gc.collect()  # the sharded modules hold reference cycles: free their memory now
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _ForwardBackward(self, command: ForwardBackward) -> tuple[list[dict[str, np.ndarray]], dict[str, float]] | None:
        trained = self.models[command.model_id]
        spec = loss_spec(command.loss_fn)
        config = resolve_config(spec, command.loss_fn, command.loss_config)
        rank, world = self.runtime.rank, self.world_size
        mine = list(range(rank, len(command.data), world))
        device = self.runtime.device
        # A rank without a datum still runs forward and backward (FSDP's collectives need every
        # rank): on one padding token, with its loss multiplied by zero.
        width = max([len(command.data[i].tokens) for i in mine], default=1)
        input_ids = torch.zeros((max(len(mine), 1), width), dtype=torch.int64)
        targets = torch.zeros_like(input_ids)
        for row, i in enumerate(mine):
            datum = command.data[i]
            n = len(datum.tokens)
            input_ids[row, :n] = torch.from_numpy(datum.tokens)
            targets[row, :n] = torch.from_numpy(datum.inputs["target_tokens"].astype(np.int64))
        outputs: list[tuple[int, dict[str, np.ndarray]]] = []
        with torch.set_grad_enabled(not command.forward_only):
            logprobs = token_logprobs(trained.model(input_ids.to(device)), targets.to(device))
            total = logprobs.sum() * 0.0
            for row, i in enumerate(mine):
                datum = command.data[i]
                n = len(datum.tokens)
                row_logprobs = logprobs[row, :n]
                inputs = {
                    k: torch.from_numpy(v.astype(np.float32)).to(device)
                    for k, v in datum.inputs.items()
                    if k != "target_tokens"
                }
                per_token = spec.fn(row_logprobs, inputs, config)
                total = total + per_token.sum()
                outputs.append(
                    (
                        i,
                        {
                            "logprobs": row_logprobs.detach().float().cpu().numpy(),
                            "elementwise_loss": per_token.detach().float().cpu().numpy(),
                        },
                    )
                )
            if not command.forward_only:
                (total * world).backward()
        loss_sum = total.detach().double().reshape(1).cpu()
        if world > 1:
            dist.all_reduce(loss_sum)
        gathered = self._gather(outputs)
        if gathered is None:
            return None
        ordered = [out for _, out in sorted(gathered, key=lambda pair: pair[0])]
        return ordered, {"loss:sum": float(loss_sum)}

    def _gather(self, items: list) -> list | None:
        """Every rank's list, concatenated on rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return items
        box: list[Any] = [None] * self.world_size if self.runtime.rank == 0 else None
        dist.gather_object(items, box, dst=0)
        return None if box is None else [x for part in box for x in part]

    def _OptimStep(self, command: OptimStep) -> dict[str, float]:
        trained = self.models[command.model_id]
        for group in trained.optimizer.param_groups:
            group.update(
                lr=command.learning_rate,
                betas=(command.beta1, command.beta2),
                eps=command.eps,
                weight_decay=command.weight_decay,
            )
        params = [p for p in trained.model.parameters() if p.grad is not None]
        max_norm = command.grad_clip_norm if command.grad_clip_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True) if params else torch.zeros(())
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        trained.optimizer.step()
        trained.optimizer.zero_grad(set_to_none=True)
        trained.optim_steps += 1
        return {"grad_norm": float(norm), "optim_steps": float(trained.optim_steps)}

    def _SaveState(self, command: SaveState) -> None:
        """DCP checkpoint of model + optimizer, committed by a rename once every rank's part is durable."""
        trained = self.models[command.model_id]
        final = Path(command.directory)
        tmp = final.with_name(f".tmp-{final.name}")
        if self.runtime.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        model_state, optim_state = get_state_dict(trained.model, trained.optimizer)
        extra = {"optim_steps": trained.optim_steps}
        dcp.save({"model": model_state, "optim": optim_state, "extra": extra}, checkpoint_id=tmp)
        self._barrier()
        if self.runtime.rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
        self._barrier()

    def _LoadState(self, command: LoadState) -> None:
        trained = self.models[command.model_id]
        model_state, optim_state = get_state_dict(trained.model, trained.optimizer)
        state: dict[str, Any] = {"model": model_state}
        if command.with_optimizer:
            state.update(optim=optim_state, extra={"optim_steps": 0})
        dcp.load(state, checkpoint_id=command.directory)
        if command.with_optimizer:
            set_state_dict(
                trained.model, trained.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
            trained.optim_steps = int(state["extra"]["optim_steps"])
        else:
            set_model_state_dict(trained.model, state["model"])
            params = [p for p in trained.model.parameters() if p.requires_grad]
            trained.optimizer = torch.optim.AdamW(params, lr=0.0, foreach=True)
            trained.optim_steps = 0
        trained.optimizer.zero_grad(set_to_none=True)

    def _PublishWeights(self, command: PublishWeights) -> dict[str, Any]:
        from weightsync.publisher import PublisherConfig
        from weightsync.trainer.config import PublishConfig
        from weightsync.trainer.publish import WeightPublisher

        trained = self.models[command.model_id]
        publisher = trained.publishers.get(command.store_model)
        if publisher is None:
            config = PublishConfig(
                store=command.store,
                model=command.store_model,
                push=command.push,
                publisher=PublisherConfig(
                    workers=2, max_in_flight=1, weights_kind="adapter" if command.kind == "adapter" else "model"
                ),
            )
            publisher = WeightPublisher(config, rank=self.runtime.rank, world_size=self.world_size)
            trained.publishers[command.store_model] = publisher
        state = trained.model.state_dict()
        if command.kind == "merged":
            state = lora.merged_state_dict(state, trained.lora_targets, trained.lora.scale)
        elif command.kind == "adapter":
            state = lora.adapter_state_dict(state)
        failures = publisher.failures
        publisher.publish(state, trained.optim_steps)
        metrics = publisher.collect(wait=True)
        if publisher.failures != failures:
            raise RuntimeError(
                f"publishing {command.store_model} to {command.store} failed (see the server log); "
                "the next save_weights_for_sampler publishes a full version"
            )
        return {"version": publisher.last_version, "ratio": metrics.get("publish/ratio")}

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


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
            dist.broadcast_object_list([command], src=0)
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
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Stop):
            return
        try:
            worker.execute(box[0])
        except Exception:  # rank 0 fails the request; this rank stays in step for the next command
            log.exception("command %s failed on this rank", type(box[0]).__name__)
