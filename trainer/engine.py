"""engine: the one training engine — a model sharded over the ranks, with its optimizer.

Every front end trains through a `TrainingEngine`: the TOML loop (`train.py`, `weightsync
train`) and the Training API (`commands.py`, which `weightsync serve-training` runs on every
rank). Its methods are collective: every rank calls them together, in the same order.

Building one (`TrainingEngine.build`), on every rank, in this order:

    define       the model on the meta device (`weightsync.models`, by the architecture's type)
    adapt        which parameters train: all (full fine-tuning), the LoRA adapters only (lora.py),
                 or none (a frozen model: the KL reference)
    partition    expert parallelism (parallel.ep): this rank's experts only (expert_parallel.py);
                 tensor parallelism (parallel.tp): each attention and MLP weight split over the tp
                 ranks (parallel.apply_tp)
    recompute    activation checkpointing of each decoder layer (trainable models, if configured)
    shard        `fully_shard` each decoder layer, then the root (parallel.py)
    materialise  the local shards only, on the device (on the host with CPU offload)
    load         the initial weights, broadcast from rank 0 (and the adapters' initial values)

A new model type is a new `define` (in `_build_model`); a new per-parameter choice (frozen, or
frozen and packed in 4/8 bits) is a new case of `_adapt`: once, for every front end.

What it does once built:

    forward_backward  a batch through the model, loss_fn(per-token log-probs), backward of the loss
                      (plus, for MoE models, the router's load-balancing loss)
    clip_gradients    the global gradient norm, clipped
    optimizer_step    AdamW with the given hyper-parameters, then the gradients are cleared
    save / load       DCP checkpoint of model, optimizer and the step count (checkpoint.py)
    weights(kind)     this rank's shards to publish: as trained, LoRA merged, or adapters only

Gradient scale: FSDP averages gradients over the data-parallel ranks, so `forward_backward`
multiplies the loss by their number (and divides it by `divisor`): the reduced gradient is that
of the sum over all ranks of loss / divisor, as on one rank. Tensor-parallel ranks of one batch
compute slices of the same gradient, never averaged; an expert's gradient (expert parallelism)
sums every rank's tokens through the dispatch and is divided by the data-parallel ranks only. Gradients accumulate across calls
(reduced only on a call with `sync_gradients`) until `optimizer_step` or `discard_gradients`.

Not here: the loop (train.py), the Training API's commands (commands.py), the loss formulas
(losses.py), the adapters (lora.py), process group, mesh and FSDP wrapping (parallel.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from weightsync.models import (
    CausalLM,
    ModelConfig,
    load_config,
    load_pretrained,
    save_pretrained,
    skeleton,
    token_logprobs,
)
from weightsync.models import packed as packing
from weightsync.models.moe import SparseMoeBlock
from weightsync.models.probe import ProbeRun, run_probe, run_top_k
from weightsync.trainer import lora as adapters
from weightsync.trainer.checkpoint import load_checkpoint, save_checkpoint
from weightsync.trainer.config import ParallelConfig
from weightsync.trainer.expert_parallel import (
    LocalExperts,
    check_ep_fits,
    is_expert_weight,
    partition_experts,
    whole_expert,
)
from weightsync.trainer.losses import LossSums, load_balancing_share, router_load
from weightsync.trainer.optim import AdamWParams, build_optimizer, set_hyperparameters
from weightsync.trainer.parallel import (
    AXIS_EP,
    AXIS_SHARD,
    apply_activation_checkpointing,
    apply_fsdp,
    apply_tp,
    check_tp_fits,
    dp_group,
    dp_rank_and_size,
    reset_rope_buffer,
    set_gradient_sync,
    tp_rank,
)

WeightsKind = Literal["full", "merged", "adapter"]
L = TypeVar("L", bound=LossSums)


def read_weights(directory: str | os.PathLike, *, rank: int) -> tuple[ModelConfig, dict[str, torch.Tensor] | None]:
    """An HF-style directory's architecture (every rank) and its fp32 weights (rank 0 only, None
    elsewhere: the build broadcasts them)."""
    if rank != 0:
        return load_config(directory), None
    return load_pretrained(directory, dtype=torch.float32)


class TrainingEngine:
    """One model on this rank's shards, its AdamW state and its optimizer step count."""

    def __init__(
        self,
        model: CausalLM,
        optimizer: torch.optim.Optimizer | None,
        *,
        mesh: DeviceMesh,
        device: torch.device,
        lora: adapters.LoraSettings | None = None,
        lora_targets: list[str] | None = None,
        compute_dtype: str = "float32",
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.config: ModelConfig = model.config
        self.device = device
        self.compute_dtype = compute_dtype
        """What the forward computes in: "bfloat16" under bf16 mixed precision, else "float32"."""
        self.lora, self.lora_targets = lora, list(lora_targets or [])
        self.dp_rank, self.dp_size = dp_rank_and_size(mesh)
        self.dp_group = dp_group(mesh)
        """The data-parallel ranks' group, for sums over the global batch (None: every rank)."""
        self.tp_rank = tp_rank(mesh)
        """0 on the rank that speaks for its tensor-parallel group's batch (outputs, loss sums)."""
        self._mesh = mesh
        self._expert_names = {
            f"{module_name}.{name}"
            for module_name, module in model.named_modules()
            if isinstance(module, LocalExperts)
            for name, _ in module.named_parameters()
        }
        self.optim_steps = 0
        """Optimizer steps taken (saved and restored with the optimizer)."""

    @classmethod
    def build(
        cls,
        architecture: ModelConfig,
        weights: Mapping[str, torch.Tensor] | None,
        *,
        mesh: DeviceMesh,
        parallel: ParallelConfig,
        device: torch.device,
        lora: adapters.LoraSettings | None = None,
        trainable: bool = True,
    ) -> TrainingEngine:
        """The engine of `architecture` holding `weights` (given on rank 0, None elsewhere); a
        frozen one (`trainable=False`) has no optimizer and only computes log-probs."""
        model, targets = _build_model(
            architecture, weights, mesh=mesh, parallel=parallel, device=device, lora=lora, trainable=trainable
        )
        optimizer = build_optimizer(model) if trainable else None
        compute_dtype = "bfloat16" if parallel.mixed_precision == "bf16" else "float32"
        return cls(
            model, optimizer, mesh=mesh, device=device, lora=lora, lora_targets=targets, compute_dtype=compute_dtype
        )

    @property
    def trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    # ------------------------------------------------------------------------- a step

    def forward_backward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        loss_fn: Callable[[torch.Tensor], L],
        *,
        divisor: torch.Tensor | float | None = None,
        sync_gradients: bool = True,
        backward: bool = True,
        token_mask: torch.Tensor | None = None,
        step_tokens: torch.Tensor | float | None = None,
    ) -> tuple[torch.Tensor, L]:
        """Forward of a batch, `loss_fn(per-token log-probs)`, and (unless `backward` is False)
        backward of its loss * dp_size / divisor, accumulating into the gradients. Returns the
        log-probs (detached) and what loss_fn returned. `sync_gradients=False` keeps this
        call's gradients local (a micro-batch before the last).

        MoE models (router_aux_loss_coef > 0) add coef * the router's load-balancing loss to
        what is backpropagated, and report its value (without the coef) in the returned metrics
        as "moe/aux_loss", times `divisor` like every loss sum (so the caller's division by its
        weight total gives it back). The loss is a mean over routed rows (real tokens x MoE
        layers; `token_mask`, (batch, tokens) bool, False on padding; None: every position),
        with this weighting (losses.load_balancing_share):

        - the expert fractions F_e are those of this call's batch on *every* rank (one
          all-reduce of N+1 numbers), and each rank adds only its own rows' terms: the reduced
          gradient does not depend on how the batch is cut over the ranks (2 ranks = 1 rank);
        - each row weighs 1 / (the rows of the whole step): `step_tokens` is the real tokens of
          every micro-batch on every rank (None: this call's), so k micro-batches add up to a
          token-weighted mean of their losses. F_e stays per micro-batch (exact over the whole
          step it would need every micro-batch routed before the first backward), so the
          gradient still depends on the micro-batch cut through F_e, as in Megatron-LM and HF.

        The Training API passes no step_tokens: each call adds coef * the load-balancing loss
        of its own batch, whatever the SDK-side loss normalisation."""
        if backward:
            set_gradient_sync(self.model, sync_gradients)
        aux_coef = self.config.router_aux_loss_coef if self.config.is_moe and backward else 0.0
        with torch.set_grad_enabled(backward), _recording_router_logits(self.model, aux_coef > 0) as router_logits:
            logprobs = token_logprobs(self.model(input_ids), targets)
            result = loss_fn(logprobs)
            aux = None
            if router_logits:
                mask = token_mask if token_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
                aux = self._load_balancing_share(router_logits, mask.to(input_ids.device), step_tokens)
                unit = 1.0 if divisor is None else divisor
                result = dataclasses.replace(result, metrics={**result.metrics, "moe/aux_loss": aux.detach() * unit})
            if backward:
                scale = self.dp_size if divisor is None else self.dp_size / divisor
                total = result.loss * scale
                if aux is not None:  # already a mean: only FSDP's average over the ranks to undo
                    total = total + aux_coef * self.dp_size * aux
                total.backward()
        return logprobs.detach(), result

    def _load_balancing_share(
        self, router_logits: list[torch.Tensor], token_mask: torch.Tensor, step_tokens: torch.Tensor | float | None
    ) -> torch.Tensor:
        """This rank's share of the step's load-balancing loss (see forward_backward)."""
        c = self.config
        load = router_load(router_logits, token_mask, num_experts=c.num_experts, top_k=c.num_experts_per_tok)
        counts = torch.cat([load.picks, load.rows.reshape(1)])
        if self.dp_size > 1:  # the mesh spans the world (parallel.build_mesh): the default group is the dp group
            dist.all_reduce(counts)
        picks, rows = counts[:-1], counts[-1]
        total_rows = (
            rows if step_tokens is None else torch.as_tensor(step_tokens, dtype=torch.float32) * len(router_logits)
        )
        return load_balancing_share(load, picks, rows, total_rows.to(rows.device))

    def logprobs(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs, without gradients (what the frozen reference model is for)."""
        with torch.no_grad():
            return token_logprobs(self.model(input_ids), targets)

    def probe(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        compute_dtypes: Sequence[torch.dtype],
        published_dtype: torch.dtype | None = torch.bfloat16,
        kind: WeightsKind = "full",
    ) -> dict[torch.dtype, ProbeRun]:
        """The parity probe's records (`weightsync.models.probe.run_probe`): the prompts through the
        model on the weights exactly as they are published (`weights(kind)`, each floating tensor
        cast to `published_dtype` as the publisher casts it), in each of `compute_dtypes`. Each
        tensor is gathered whole one at a time: one all-gather of the model, and a layer's weights
        of memory, whatever the sharding. Collective: every rank calls it alike."""
        weights = self.weights(kind)
        ep_group = self._mesh[AXIS_EP].get_group() if self._expert_names else None

        def published(name: str) -> torch.Tensor:
            if ep_group is not None and is_expert_weight(name):  # each ep rank holds its own experts
                whole = whole_expert(name, weights, ep_group, self.config.num_experts)
            else:
                tensor = weights[name]
                whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if published_dtype is not None and whole.is_floating_point():
                whole = whole.to(published_dtype)
            return whole.to(self.device)

        return run_probe(self.config, prompts, published, dtypes=compute_dtypes, device=self.device)

    def probe_training(self, prompts: Sequence[Sequence[int]], top_k: int) -> ProbeRun:
        """The parity probe's prompts through the training forward as the model trains (its own
        weights, its compute precision; LoRA adapters applied): each position's `top_k` most likely
        next tokens with their log-probs (`weightsync.models.probe.run_top_k`), what the policy
        would sample. Collective: every rank calls it alike."""
        return run_top_k(self.model, prompts, top_k, device=self.device)

    def clip_gradients(self, max_norm: float) -> float:
        """Clips the gradients to a global norm of `max_norm` (0: no clipping); returns the norm
        before clipping, over every rank's shards (0 without gradients)."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.grad is not None]
        params = [p for _, p in named]
        if not params:
            return 0.0
        groups = _by_mesh(named, self._expert_names)
        if len(groups) == 1 and not self._expert_names:  # one mesh (FSDP, HSDP): torch's own clipping
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
            return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        # Several meshes (tensor- or expert-parallel weights beside FSDP-only ones): each group's
        # norm over its own mesh, the experts' summed over the ep ranks too (each holds others),
        # then one coefficient for the whole model.
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for (_, experts), grads in groups.items():
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            square = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).double() ** 2
            if experts:
                dist.all_reduce(square, group=self._mesh[AXIS_EP].get_group())
            squares = squares + square
        total = float(squares.sqrt())
        if max_norm > 0 and total > max_norm:
            coefficient = max_norm / (total + 1e-6)  # what clip_grad_norm_ multiplies by
            for p in params:
                p.grad.mul_(coefficient)
        return total

    def optimizer_step(self, params: AdamWParams) -> None:
        """One AdamW step on the accumulated gradients, with these hyper-parameters; the gradients are then cleared."""
        set_hyperparameters(self.optimizer, params)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.optim_steps += 1

    def discard_gradients(self) -> None:
        """Drops the accumulated gradients without a step (a step the guard refused)."""
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ state, weights

    def save(self, directory: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> Path:
        """A DCP checkpoint of model and optimizer in `directory`, with this rank's `extra` values
        and the optimizer step count; committed once every rank's part is durable."""
        return save_checkpoint(
            directory, self.model, self.optimizer, {**(extra or {}), "optim_steps": self.optim_steps}
        )

    def load(self, directory: str | os.PathLike, *, with_optimizer: bool = True) -> dict[str, Any]:
        """Restores a checkpoint `save` wrote (or one of another rank count: DCP reshards it);
        returns this rank's extras. Without the optimizer only the weights are restored and the
        optimizer starts afresh (no moments, step count 0). Pending gradients are dropped."""
        extra = load_checkpoint(directory, self.model, self.optimizer if with_optimizer else None)
        if with_optimizer:
            self.optim_steps = int(extra.get("optim_steps", 0))
        else:
            self.optimizer, self.optim_steps = build_optimizer(self.model), 0
        self.optimizer.zero_grad(set_to_none=True)
        return extra

    def weights(self, kind: WeightsKind = "full") -> dict[str, torch.Tensor]:
        """This rank's shards (DTensors, by HF name) to publish: "full" (the model as trained),
        "merged" (LoRA folded into the base weights, the plain model's names) or "adapter" (the
        LoRA tensors only). Packed frozen experts are given as their bf16 values under the HF
        names (`...experts.E.gate_proj.weight`): what the model computes with."""
        state = packing.dequantized_state_dict(self.model, self.model.state_dict())
        if kind == "full":
            return state
        if self.lora is None:
            raise ValueError(f"{kind!r} weights need a LoRA model; this one is fully fine-tuned")
        if kind == "merged":  # the targets this rank holds (expert parallelism: its experts')
            targets = [t for t in self.lora_targets if f"{t}.weight" in state]
            return adapters.merged_state_dict(state, targets, self.lora.scale)
        if kind == "adapter":
            return adapters.adapter_state_dict(state)
        raise ValueError(f"weights kind must be 'full', 'merged' or 'adapter', got {kind!r}")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The gathered fp32 state dict on rank 0 ({} elsewhere). For tests and exports: training
        and publishing never gather. Packed experts are given dequantized (bf16, HF names)."""
        if not self._expert_names:
            state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            return packing.dequantized_state_dict(self.model, state)
        # Expert parallelism: each ep rank gathers its own experts (over dp_shard), and the
        # dp_shard-0 rank of every ep group sends them to rank 0.
        state = {}
        for name, tensor in self.model.state_dict().items():
            state[name] = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()
        mine = {n: t for n, t in state.items() if n in self._expert_names}
        parts: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine if self._mesh.get_local_rank(AXIS_SHARD) == 0 else {}, parts, dst=0)
        if parts is None:
            return {}
        for part in parts:
            state.update(part)
        return dict(sorted(state.items()))

    def export_pretrained(self, directory: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> None:
        """Rank 0 writes the model as an HF-style directory (gathered there); every rank returns
        once it is written."""
        state = self.full_state_dict()
        if dist.get_rank() == 0:
            save_pretrained(directory, self.config, state, dtype=dtype)
        dist.barrier()


@contextlib.contextmanager
def _recording_router_logits(model: CausalLM, enabled: bool) -> Iterator[list[torch.Tensor]]:
    """Collects each MoE layer's router logits, in layer order, while the block is active (an
    empty list when not `enabled`).

    Forward hooks on the routers rather than `CausalLM.forward(router_logits=list)`: FSDP2's
    pre-forward of each sharded layer rebuilds its arguments once they hold a tensor that
    requires grad (to register its post-backward hook), so from the second layer on the layers
    appended to a copy of the list and only the first MoE layer's logits came back."""
    logits: list[torch.Tensor] = []
    if not enabled:
        yield logits
        return
    hooks = [
        module.gate.register_forward_hook(lambda _module, _args, output: logits.append(output))
        for module in model.modules()
        if isinstance(module, SparseMoeBlock)
    ]
    try:
        yield logits
    finally:
        for hook in hooks:
            hook.remove()


def _build_model(
    architecture: ModelConfig,
    weights: Mapping[str, torch.Tensor] | None,
    *,
    mesh: DeviceMesh,
    parallel: ParallelConfig,
    device: torch.device,
    lora: adapters.LoraSettings | None,
    trainable: bool,
) -> tuple[CausalLM, list[str]]:
    """The sharded model and its LoRA target layers: define, adapt, recompute, shard,
    materialise, load (the module docstring). No rank materialises the whole model."""
    model = skeleton(architecture)
    frozen_experts = packing.PackFormat.parse(parallel.frozen_experts) if parallel.frozen_experts else None
    targets = _adapt(model, lora=lora, trainable=trainable, frozen_experts=frozen_experts)
    experts = _partition(model, mesh, parallel)
    if parallel.activation_checkpointing and trainable:
        apply_activation_checkpointing(model)
    dp_size = dp_rank_and_size(mesh)[1]
    apply_fsdp(model, mesh, parallel, device=device, experts=experts, gradient_divide_factor=dp_size)
    model.to_empty(device="cpu" if parallel.cpu_offload else device)
    reset_rope_buffer(model)
    state = dict(weights) if weights is not None else {}  # the call below overwrites its argument
    if weights is not None and targets:
        shapes = {name: tuple(t.shape) for name, t in weights.items()}
        state.update(adapters.initial_adapters(shapes, targets, lora))
    if weights is not None:
        state = packing.pack_state_dict(state, model)  # rank 0 packs from the fp32 weights
    # Rank 0 broadcasts every tensor and each rank keeps its own; with expert parallelism rank 0
    # holds only its experts, so its load is not strict: `_check_loaded` is, on every rank.
    own = set(model.state_dict())
    set_model_state_dict(
        model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=not experts)
    )
    if experts:
        _check_loaded(own, state)
    if not trainable:
        model.eval()
    return model, targets


def _partition(model: CausalLM, mesh: DeviceMesh, parallel: ParallelConfig) -> list[torch.nn.Module]:
    """Expert and tensor parallelism on the meta model (before FSDP); returns the layers' local
    expert containers (empty without expert parallelism)."""
    if parallel.ep > 1:
        check_ep_fits(model.config.num_experts, parallel.ep)
        if not model.config.is_moe:
            raise ValueError("parallel.ep > 1 needs a Mixture-of-Experts model; this one is dense")
        group = mesh[AXIS_EP].get_group()
        return partition_experts(model, group, parallel.ep, mesh.get_local_rank(AXIS_EP))
    if parallel.tp > 1:
        check_tp_fits(model.config, parallel.tp)
        apply_tp(model, mesh)
    return []


def _check_loaded(own: set[str], state: Mapping[str, torch.Tensor]) -> None:
    """Every rank's tensors were among rank 0's initial weights (a non-strict load must not leave
    one uninitialised)."""
    names = set(state) if dist.get_rank() == 0 else None
    box = [names]
    dist.broadcast_object_list(box, src=0)
    missing = sorted(own - box[0])
    if missing:
        raise ValueError(f"the initial weights lack {len(missing)} tensors this rank holds, e.g. {missing[:3]}")


def _by_mesh(named: list[tuple[str, torch.Tensor]], experts: set[str]) -> dict[tuple[int, bool], list[torch.Tensor]]:
    """Gradients grouped by their mesh (and whether they are an expert's), in parameter order."""
    groups: dict[tuple[int, bool], list[torch.Tensor]] = {}
    for name, p in named:
        mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        groups.setdefault((id(mesh), name in experts), []).append(p.grad)
    return groups


def _adapt(
    model: CausalLM,
    *,
    lora: adapters.LoraSettings | None,
    trainable: bool,
    frozen_experts: packing.PackFormat | None = None,
) -> list[str]:
    """Decides, per parameter and before sharding, what trains: every parameter (full
    fine-tuning), the LoRA adapters only (attached here; the base weights frozen), or nothing (a
    frozen model). With `frozen_experts` (parallel.frozen_experts) a MoE model's routed experts
    are frozen whatever else trains, and held in that format (models/packed.py): their
    projections become PackedLinear layers, which FSDP2 then shards like any layer's weights.
    Returns the LoRA target layers."""
    if not trainable:
        model.requires_grad_(False)
        targets = []
    else:
        targets = adapters.attach(model, lora) if lora is not None else []
    if frozen_experts is not None and model.config.is_moe:
        packing.pack_experts(model, frozen_experts)
    return targets
