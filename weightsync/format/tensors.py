"""tensors: the torch boundary — snapshots of state dicts as raw bytes, and tensors back.

The rest of the library sees a model as `Snapshot`: tensor name -> (dtype, shape, flat uint8
numpy array of its little-endian bit patterns). Taking a snapshot is the only part of a
publish the caller waits for, so it is one copy (with the cast to the publish dtype fused in)
and nothing else. Not here: anything about torch.distributed (the trainer hands in its local
shards), encoding or storage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np
import torch

from weightsync.errors import LayoutError, UnsupportedFormatError
from weightsync.format.dtypes import DType, dtype_by_name
from weightsync.format.manifest import check_tensor_name


@dataclasses.dataclass(frozen=True)
class SnapshotTensor:
    dtype: DType
    shape: tuple[int, ...]
    data: np.ndarray  # flat uint8, the raw bytes; owned by the snapshot, never the caller's memory

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


Snapshot = dict[str, SnapshotTensor]


def dtype_of(tensor: torch.Tensor) -> DType:
    name = str(tensor.dtype).removeprefix("torch.")
    return dtype_by_name(name)


def torch_dtype(dtype: DType) -> torch.dtype:
    try:
        return getattr(torch, dtype.name)
    except AttributeError:
        raise UnsupportedFormatError(f"this torch build has no dtype {dtype.name}") from None


def take_snapshot(
    state_dict: Mapping[str, torch.Tensor], cast_floats_to: str | None = None, *, reuse: Snapshot | None = None
) -> Snapshot:
    """Copies every tensor to host memory as raw bytes, casting floating tensors if asked.

    `reuse` is a snapshot nobody reads any more: tensors of the same name, dtype and shape are
    copied into its buffers instead of fresh memory, which saves the page faults that otherwise
    cost more than the copy itself (3-10x on a fresh 64 MB snapshot).
    Raises LayoutError for non-tensors, UnsupportedFormatError for dtypes the format lacks.
    """
    reuse = reuse or {}
    return {
        name: copy_tensor(state_dict[name], dtype, shape, reuse.get(name))
        for name, (dtype, shape) in snapshot_layout(state_dict, cast_floats_to).items()
    }


def snapshot_layout(
    state_dict: Mapping[str, torch.Tensor], cast_floats_to: str | None = None
) -> dict[str, tuple[DType, tuple[int, ...]]]:
    """What a snapshot of `state_dict` will hold, name -> (dtype, shape), checked before anything
    is copied (a publisher plans a version from it and encodes tensors as they are copied).
    Raises LayoutError for non-tensors, UnsupportedFormatError for dtypes the format lacks."""
    target = dtype_by_name(cast_floats_to) if cast_floats_to else None
    out = {}
    for name in state_dict:
        check_tensor_name(name)
        tensor = state_dict[name]
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{name!r} is a {type(tensor).__name__}, not a tensor")
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise LayoutError(f"{name!r} is a {tensor.layout} tensor; only dense tensors are published")
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            raise LayoutError(f"{name!r} is a {type(tensor).__name__}; hand in local tensors (e.g. DTensor.to_local())")
        dtype = dtype_of(tensor)
        if target is not None and dtype.floating and dtype != target:
            dtype = target
        out[name] = (dtype, tuple(tensor.shape))
    return out


def copy_tensor(
    tensor: torch.Tensor, dtype: DType, shape: tuple[int, ...], spare: SnapshotTensor | None = None
) -> SnapshotTensor:
    """One tensor of a snapshot: its bytes in `spare`'s buffer when that fits, else fresh memory."""
    if spare is not None and spare.dtype == dtype and spare.shape == shape:
        _copy_into(spare.data, tensor.detach(), dtype, shape)
        return spare
    host = torch.empty(shape, dtype=torch_dtype(dtype), device="cpu")
    _copy_into(raw_bytes(host), tensor.detach(), dtype, shape)
    return SnapshotTensor(dtype, shape, raw_bytes(host))


def _copy_into(out: np.ndarray, tensor: torch.Tensor, dtype: DType, shape: tuple[int, ...]) -> None:
    """Copies `tensor` into the raw bytes `out`. A contiguous CPU tensor already in the publish
    dtype is a plain memcpy through numpy: torch's copy_ wakes its intra-op thread pool for every
    tensor, which on a loaded machine cost ~8 ms per tensor (0.4 s for an 80-tensor 0.1 GiB model
    whose bytes copy in 0.02 s)."""
    if tensor.device.type == "cpu" and tensor.is_contiguous() and dtype_of(tensor) == dtype and out.nbytes:
        np.copyto(out, raw_bytes(tensor))
    else:
        to_tensor(out, dtype, shape).copy_(tensor)


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a flat uint8 numpy array (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def to_tensor(data: np.ndarray, dtype: DType, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over raw bytes (no copy): the inverse of `raw_bytes`."""
    if data.nbytes != math.prod(shape) * dtype.itemsize:
        raise LayoutError(f"{data.nbytes} bytes cannot hold a {dtype.name} tensor of shape {shape}")
    if data.nbytes == 0:  # numpy gives empty arrays stride 0, which torch cannot re-view
        return torch.empty(shape, dtype=torch_dtype(dtype))
    flat = torch.from_numpy(data.view(np.uint8)).view(torch_dtype(dtype))
    return flat.reshape(shape)


def layout_of(tensors: Mapping) -> dict[str, tuple]:
    """name -> (dtype, shape) of a snapshot (dtypes by the format's names) or of torch tensors
    (torch dtypes): what a later version or swap is checked against (`describe_layout_change`)."""
    return {name: (getattr(t.dtype, "name", t.dtype), tuple(t.shape)) for name, t in tensors.items()}


def describe_layout_change(expected: Mapping, actual: Mapping, *, expected_is: str, most: int = 3) -> str:
    """How layout `actual` (name -> (dtype, shape)) differs from `expected`, in one line: the
    tensors missing and unexpected (counted, up to `most` named per kind), then each tensor whose shape or
    dtype differs, as "NAME has shape (267, 64), {expected_is} needs (259, 64)". An expected dtype
    of None accepts any dtype. "" when they agree. The one wording of a layout mismatch, whoever
    finds it: the publisher (why a version is full), the reader (a delta that changes its parent's
    layout), an engine (a version that does not fit what it serves)."""

    def names(found: list[str]) -> str:
        return ", ".join(found[:most]) + (f" and {len(found) - most} more" if len(found) > most else "")

    missing = sorted(set(expected) - set(actual))
    unexpected = sorted(set(actual) - set(expected))
    parts = [f"{len(missing)} missing: {names(missing)}"] if missing else []
    parts += [f"{len(unexpected)} unexpected: {names(unexpected)}"] if unexpected else []
    for name in sorted(set(expected) & set(actual)):
        (want_dtype, want_shape), (dtype, shape) = expected[name], actual[name]
        if tuple(shape) != tuple(want_shape):
            parts.append(f"{name} has shape {tuple(shape)}, {expected_is} needs {tuple(want_shape)}")
        elif want_dtype is not None and dtype != want_dtype:
            parts.append(f"{name} is {dtype}, {expected_is} needs {want_dtype}")
        if len(parts) >= 2 * most + 2:
            parts.append("...")
            break
    return "; ".join(parts)
