"""parallel: process group, DeviceMesh, and the tensor-parallel and FSDP2 wrapping of the decoder.

`init_runtime` joins the process group torchrun describes (or reuses one that is already up),
picks the device from LOCAL_RANK and the backend from it; `build_mesh` turns ParallelConfig's
degrees into a DeviceMesh once; `apply_tp`, `apply_activation_checkpointing` and `apply_fsdp`
(each decoder layer, then the root) are the steps the engine's build runs on a model still on
the meta device (expert parallelism is `expert_parallel.py`); `broadcast_object` hands rank 0's
Python object to every rank.

The mesh's axes, outermost first:

    dp_replicate, dp_shard    HSDP / FSDP (data parallel: each rank a different batch)
    dp_shard, tp              FSDP x tensor parallelism: the tp ranks of one dp_shard index see the
                              same batch and each holds a slice of every attention and MLP weight
    dp_shard, ep              FSDP x expert parallelism (MoE): every rank a different batch; each
                              ep rank holds num_experts / ep of the experts, FSDP-sharded over
                              dp_shard, and the dense weights are FSDP-sharded over all ranks
                              (the flattened "dp" axis)

Not here: what the model computes (`weightsync.models`), building the sharded model and its
optimizer (engine.py), checkpoints.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from weightsync.models import CausalLM, ModelConfig, rope_inv_freq
from weightsync.trainer.config import ParallelConfig

log = logging.getLogger(__name__)

AXIS_REPLICATE = "dp_replicate"
AXIS_SHARD = "dp_shard"
AXIS_TP = "tp"
AXIS_EP = "ep"
AXIS_DP = "dp"  # dp_shard x ep flattened: the ranks that FSDP-shard the dense weights under EP


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where this process runs inside the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    owns_process_group: bool
    """True when init_runtime created the process group (and close_runtime should end it)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_runtime(config: ParallelConfig, *, timeout_s: float = 600.0) -> Runtime:
    """Joins (or reuses) the default process group and picks this rank's device.

    Under torchrun the environment names rank, world size and rendezvous; a plain
    `python -m weightsync.trainer.train` runs as a world of one.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError('parallel.device = "cuda" but CUDA is not available; use device = "auto" or "cpu"')
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owns = not dist.is_initialized()
    if owns:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(
            backend=_backend(config, use_cuda),
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if use_cuda else None,
        )
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, device, owns)


def _backend(config: ParallelConfig, use_cuda: bool) -> str:
    if config.backend == "gloo" or not use_cuda:
        return "gloo"
    if config.backend == "nccl" and not config.cpu_offload:
        return "nccl"
    # CPU-offloaded gradients are clipped (an all-reduce of CPU tensors) on the host: give CPU
    # tensors a gloo group beside NCCL, as torchtitan does.
    return "cuda:nccl,cpu:gloo"


def close_runtime(runtime: Runtime) -> None:
    if runtime.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


def exit_worker(code: int) -> NoReturn:
    """Ends a torchrun worker whose work is done and whose process group is closed, without
    interpreter finalization (logs and stdio flushed first).

    FSDP2 keeps the gloo process group alive after destroy_process_group: its `pt_gloo_runloop`
    threads were still up after the model was deleted and gc had run (its mesh info outlives
    both), so the group is torn down only while the interpreter finalizes. A two-rank run that
    had finished every step then aborted there in CI, on a loaded machine ("terminate called
    without an active exception", exit -6, and torchrun reports the run failed). Our reading,
    which torch's own destroy_process_group comments describe for hooks: a gloo thread that
    drops a collective's tensor needs the GIL while the interpreter is going away.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def build_mesh(config: ParallelConfig, runtime: Runtime) -> DeviceMesh:
    """A 1-D ("dp_shard",) mesh for FSDP, 2-D ("dp_replicate", "dp_shard") for HSDP, ("dp_shard",
    "tp") with tensor parallelism, ("dp_shard", "ep") with expert parallelism (see the module
    docstring)."""
    replicate, shard = config.mesh_shape(runtime.world_size)
    device = runtime.device.type
    if config.tp > 1:
        return init_device_mesh(device, (shard, config.tp), mesh_dim_names=(AXIS_SHARD, AXIS_TP))
    if config.ep > 1:
        return init_device_mesh(device, (shard, config.ep), mesh_dim_names=(AXIS_SHARD, AXIS_EP))
    if replicate == 1:
        return init_device_mesh(device, (shard,), mesh_dim_names=(AXIS_SHARD,))
    return init_device_mesh(device, (replicate, shard), mesh_dim_names=(AXIS_REPLICATE, AXIS_SHARD))


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP shards the dense weights over: every data-parallel rank (under TP, the
    dp_shard ranks of this rank's tp index; under EP, all ranks)."""
    names = mesh.mesh_dim_names or ()
    if AXIS_TP in names:
        return mesh[AXIS_SHARD]
    if AXIS_EP in names:  # made once, then the same mesh (the root keeps its flattened meshes)
        return mesh[AXIS_SHARD, AXIS_EP]._flatten(AXIS_DP)
    return mesh


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among all data-parallel ranks (replicas x shards, x ep ranks), and their
    count. Tensor-parallel ranks of one index see the same batch."""
    dp = fsdp_mesh(mesh)
    if dp.ndim == 1:
        return dp.get_local_rank(), dp.size()
    replicate, shard = dp.get_local_rank(AXIS_REPLICATE), dp.get_local_rank(AXIS_SHARD)
    return replicate * dp.size(1) + shard, dp.size()


def dp_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """The process group of this rank's data-parallel ranks, for sums over the global batch; None
    (the default group) when they are every rank."""
    dp = fsdp_mesh(mesh)
    return None if dp.size() == dist.get_world_size() or dp.ndim != 1 else dp.get_group()


def tp_rank(mesh: DeviceMesh) -> int:
    """This rank's index in its tensor-parallel group (0 without TP): rank 0 of each group speaks
    for the group's batch (its outputs and loss sums), the others compute the same."""
    return mesh.get_local_rank(AXIS_TP) if AXIS_TP in (mesh.mesh_dim_names or ()) else 0


def check_tp_fits(config: ModelConfig, tp: int) -> None:
    """ValueError unless tensor parallelism of degree `tp` can split this model's heads and MLP."""
    if config.is_moe:
        raise ValueError(
            "parallel.tp > 1 is for dense models; a Mixture-of-Experts model is split with parallel.ep "
            "(tensor parallelism of the experts is not built)"
        )
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(config, name) % tp:
            raise ValueError(f"parallel.tp = {tp} must divide the model's {name} ({getattr(config, name)})")


def apply_tp(model: CausalLM, mesh: DeviceMesh) -> None:
    """torchtitan-style tensor parallelism over the "tp" axis: q/k/v and gate/up column-parallel
    (each rank a slice of the heads and of the MLP width), o and down row-parallel (their outputs
    summed across the ranks); the embedding row-parallel over the vocabulary and lm_head
    column-parallel with its logits gathered (unless they are tied: then both stay whole). Qwen3's
    per-head q/k norms see the local heads as a shard of the head dim (their weight's gradient is
    summed over the tp ranks); the other norms see whole hidden states and stay whole on every tp
    rank. FSDP then shards everything over dp_shard.

    The attention reads its local head counts from the projections' outputs (models/decoder.py).
    LoRA adapters attached before are split to match their layer: a column-parallel layer's
    lora_B like its rows, a row-parallel layer's lora_A like its columns, the other whole."""
    tp = mesh[AXIS_TP]
    colwise, rowwise = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")
    plan: dict = {}
    for i, layer in enumerate(model.model.layers):
        for name, _ in layer.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in colwise or leaf in rowwise:
                plan[f"model.layers.{i}.{name}"] = _lora_aware(
                    ColwiseParallel() if leaf in colwise else RowwiseParallel()
                )
            elif leaf in ("q_norm", "k_norm"):  # one weight for every head: its gradient sums the tp ranks' heads
                plan[f"model.layers.{i}.{name}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if not model.config.tie_word_embeddings:
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        plan["lm_head"] = _lora_aware(ColwiseParallel(output_layouts=Replicate()))
    # The styles make every weight they split a new Parameter that requires grad: keep frozen
    # weights (LoRA's base, a frozen reference model) frozen.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp, plan)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)


def _lora_aware(style):
    """A column- or row-parallel style that leaves a layer's LoRA adapters (child modules) to
    `_split_adapters` instead of sharding them like the layer's own weight."""
    partition = style._partition_linear_fn

    def partition_linear(name, module, mesh):
        if name:  # an adapter, visited after its layer (which split it already)
            return
        adapters = {k: module._modules.pop(k) for k in ("lora_A", "lora_B") if k in module._modules}
        partition(name, module, mesh)
        module._modules.update(adapters)
        if adapters:
            _split_adapters(module, mesh, colwise=isinstance(style, ColwiseParallel))

    style._partition_linear_fn = partition_linear
    return style


def _split_adapters(module: nn.Module, mesh: DeviceMesh, *, colwise: bool) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded, whole = ("lora_B", "lora_A") if colwise else ("lora_A", "lora_B")
    for child, placement in ((sharded, Shard(0) if colwise else Shard(1)), (whole, Replicate())):
        linear = getattr(module, child)
        linear.weight = nn.Parameter(
            distribute_tensor(linear.weight, mesh, [placement]), requires_grad=linear.weight.requires_grad
        )


def apply_activation_checkpointing(model: CausalLM) -> None:
    """Recomputes each decoder layer in backward.

    The layer's forward is wrapped in place rather than the layer in a CheckpointWrapper, so
    parameter names stay the HF names that checkpoints and published versions carry.
    """
    for layer in model.model.layers:
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = checkpointed


def apply_fsdp(
    model: CausalLM,
    mesh: DeviceMesh,
    config: ParallelConfig,
    *,
    device: torch.device,
    experts: list[nn.Module] = (),
    gradient_divide_factor: int | None = None,
) -> None:
    """`fully_shard` each decoder layer (the unit of all-gather), then the root (embeddings,
    final norm, output projection), over `fsdp_mesh(mesh)`. `experts` (expert parallelism): each
    layer's local experts first, over dp_shard only, with their reduced gradient divided by
    `gradient_divide_factor` (every data-parallel rank) instead of their own group's size:
    their gradient already sums the tokens of every ep rank, and is not averaged over them."""
    kwargs: dict = {"mesh": fsdp_mesh(mesh)}
    if config.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if config.cpu_offload:
        # Pinned host memory needs an accelerator; without one, pinning fails outright.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    else:
        kwargs["offload_policy"] = OffloadPolicy()
    for module in experts:
        fully_shard(module, **{**kwargs, "mesh": mesh[AXIS_SHARD]})
        module.set_gradient_divide_factor(float(gradient_divide_factor))
        module.set_force_sum_reduction_for_comms(True)  # a sum, then the division: gloo has no PREMUL_SUM
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        # The last layer's weights are needed again at once by backward: keep them gathered.
        reshard = config.reshard_after_forward and i < len(layers) - 1
        fully_shard(layer, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=config.reshard_after_forward, **kwargs)


def reset_rope_buffer(model: CausalLM) -> None:
    """Recomputes the RoPE inverse frequencies, which `to_empty` left uninitialised (the
    buffer is not persistent, so no state dict carries it). Same formula as CausalLM.__init__."""
    with torch.no_grad():
        model.inv_freq.copy_(rope_inv_freq(model.config, model.inv_freq.device))


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Reduce-scatter gradients after this backward (the last micro-batch) or keep accumulating."""
    model.set_requires_gradient_sync(enabled)


def broadcast_object(obj: Any = None, *, src: int = 0) -> Any:
    """Rank `src`'s `obj` (any picklable value), returned on every rank; the others pass nothing."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
