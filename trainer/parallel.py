"""parallel: process group, DeviceMesh and the FSDP2 wrapping of the decoder.

`init_runtime` joins the process group torchrun describes (or reuses one that is already up),
picks the device from LOCAL_RANK and the backend from it; `build_mesh` turns ParallelConfig's
degrees into a DeviceMesh once; `apply_activation_checkpointing` and `apply_fsdp` (each decoder
layer, then the root) are the steps the engine's build runs on a model still on the meta
device; `broadcast_object` hands rank 0's Python object to every rank.

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
from torch.utils.checkpoint import checkpoint

from weightsync.models import CausalLM, rope_inv_freq
from weightsync.trainer.config import ParallelConfig

log = logging.getLogger(__name__)

AXIS_REPLICATE = "dp_replicate"
AXIS_SHARD = "dp_shard"


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
    """A 1-D ("dp_shard",) mesh for FSDP, or 2-D ("dp_replicate", "dp_shard") for HSDP."""
    replicate, shard = config.mesh_shape(runtime.world_size)
    if replicate == 1:
        return init_device_mesh(runtime.device.type, (shard,), mesh_dim_names=(AXIS_SHARD,))
    return init_device_mesh(runtime.device.type, (replicate, shard), mesh_dim_names=(AXIS_REPLICATE, AXIS_SHARD))


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """This rank's index among all data-parallel ranks (replicas x shards), and their count."""
    if mesh.ndim == 1:
        return mesh.get_local_rank(), mesh.size()
    replicate, shard = mesh.get_local_rank(AXIS_REPLICATE), mesh.get_local_rank(AXIS_SHARD)
    return replicate * mesh.size(1) + shard, mesh.size()


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


def apply_fsdp(model: CausalLM, mesh: DeviceMesh, config: ParallelConfig, *, device: torch.device) -> None:
    """`fully_shard` each decoder layer (the unit of all-gather), then the root (embeddings,
    final norm, output projection)."""
    kwargs: dict = {"mesh": mesh}
    if config.mixed_precision == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if config.cpu_offload:
        # Pinned host memory needs an accelerator; without one, pinning fails outright.
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    else:
        kwargs["offload_policy"] = OffloadPolicy()
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
