"""pieces: which part of each tensor this rank holds (as boxes), and which of those it publishes.

A DTensor's local tensor is, on every dim, a list of the global tensor's indices: each mesh axis
that shards dim d (`Shard(d)`, or FSDP's `_StridedShard(d)` over a tensor-parallel shard of it)
cuts the indices the axes before it left, in mesh order, as DTensor itself does (`local_indices`).
Runs of consecutive indices make boxes, in the local tensor's element order (`pieces_of`): a
dim-0 FSDP shard is one box that is a flat range, and stays one (the format every reader reads); a
row-parallel weight is a column block; FSDP over a vocabulary- or column-parallel weight one or
several row blocks. A plain tensor is whole.

Several ranks hold the same piece: a tensor replicated along a mesh axis, a tensor-parallel rank's
norm weights (FSDP-sharded on the data-parallel ranks, replicated across the tensor-parallel
ones), every plain tensor of a data-parallel trainer. Each piece is published by the lowest rank
that holds it, found by one exchange of piece digests among all ranks (`Ownership`), repeated only
when some rank's pieces change; ranks that do not publish a piece still declare its tensor, so the
commit knows the whole tensor set (docs/format.md, note 12). The exchange also names the job's
layout (`layout_key`), the same on every rank: when it changes, every rank's next version is full.

Not here: publishing (publish.py), the placements the model is built with (parallel.py), the
format's boxes (weightsync/format/boxes.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP over a tensor-parallel dim

from weightsync.errors import LayoutError
from weightsync.format.boxes import Box
from weightsync.format.hashing import xxh3_hex
from weightsync.shards import Placement


def local_indices(tensor: DTensor) -> list[torch.Tensor]:
    """Per dim, the global indices of the local tensor's positions, in order (int64)."""
    indices = [torch.arange(size) for size in tensor.shape]
    coordinate = tensor.device_mesh.get_coordinate()
    if coordinate is None:
        raise LayoutError("this rank is not in the tensor's mesh; it holds none of it")
    for axis, placement in enumerate(tensor.placements):
        if placement.is_shard() or isinstance(placement, _StridedShard):  # cut what the earlier axes left
            dim = placement.dim
            along = indices[dim].reshape(
                [-1 if d == dim else 1 for d in range(len(indices))]
            )  # the placement's own dim
            pieces, _ = placement._split_tensor(along, tensor.device_mesh.size(axis), with_padding=False)
            indices[dim] = pieces[coordinate[axis]].reshape(-1)
        elif not placement.is_replicate():
            raise LayoutError(f"cannot publish a tensor with placement {placement} (reduce it first)")
    return indices


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """(first global index, length) of each run of consecutive indices, in order."""
    if index.numel() == 0:
        return []
    breaks = (torch.nonzero(index[1:] != index[:-1] + 1).reshape(-1) + 1).tolist()
    starts = [0, *breaks]
    stops = [*breaks, index.numel()]
    return [(int(index[a]), b - a) for a, b in zip(starts, stops, strict=True)]


def boxes_of(indices: list[torch.Tensor]) -> list[Box]:
    """The boxes whose elements, in order, are the local tensor's: the Cartesian product of the
    per-dim index lists. Dims after the last one with several runs are whole; at that dim each
    run is a box, and every index of the dims before it one box of its own."""
    runs = [_runs(index) for index in indices]
    if any(not r for r in runs):
        return []
    split = max((d for d, r in enumerate(runs) if len(r) > 1), default=-1)
    if split < 0:
        return [Box(tuple(r[0][0] for r in runs), tuple(r[0][1] for r in runs))]
    outer = [index.tolist() for index in indices[:split]]
    tail_offsets = tuple(r[0][0] for r in runs[split + 1 :])
    tail_sizes = tuple(r[0][1] for r in runs[split + 1 :])
    boxes = []
    for prefix in _product(outer):
        for first, length in runs[split]:
            boxes.append(Box((*prefix, first, *tail_offsets), ((1,) * split + (length,) + tail_sizes)))
    return boxes


def _product(lists: list[list[int]]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for values in lists:
        out = [(*p, v) for p in out for v in values]
    return out


def placement_of(tensor: torch.Tensor) -> Placement:
    """Where this rank's local tensor sits: a flat start for a whole tensor or a dim-0 shard (what
    FSDP alone makes), boxes for anything else. The form depends only on the DTensor's placements,
    which every rank shares, so the ranks of one tensor always agree on it."""
    shape = tuple(tensor.shape)
    if not isinstance(tensor, DTensor):
        return Placement(shape, start=0)
    indices = local_indices(tensor)
    plain_dim0 = all(
        p.is_replicate() or (p.is_shard() and not isinstance(p, _StridedShard) and p.dim == 0)
        for p in tensor.placements
    )
    if plain_dim0:
        rows = indices[0] if shape else torch.zeros(1, dtype=torch.long)
        start = int(rows[0]) * math.prod(shape[1:]) if shape and rows.numel() else 0
        if shape and rows.numel() == 0:  # an empty shard (more ranks than rows): at the end
            start = math.prod(shape)
        return Placement(shape, start=start)
    return Placement(shape, boxes=tuple(boxes_of(indices)))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    local = local.detach()
    return local if local.is_contiguous() else local.contiguous()


def _piece_key(name: str, local: torch.Tensor, placement: Placement) -> str:
    """A digest naming this rank's piece: ranks with equal keys hold the same elements."""
    region = placement.start if placement.boxes is None else [b.to_json() for b in placement.boxes]
    return xxh3_hex(repr((name, str(local.dtype), placement.global_shape, region, local.numel())).encode())


def _empty(placement: Placement) -> Placement:
    """A placement that declares the tensor and publishes none of it, in the tensor's own form."""
    if placement.boxes is None:
        return Placement(placement.global_shape, start=0)
    return Placement(placement.global_shape, boxes=())


@dataclasses.dataclass
class Ownership:
    """Which pieces this rank publishes: the ones no lower rank holds (a collective: every rank
    calls `collect` at the same publish)."""

    _keys: tuple[str, ...] | None = None  # this rank's piece keys at the last exchange
    _owned: frozenset[str] = frozenset()
    layout_key: str | None = None
    """A digest of every rank's pieces; equal on all ranks (Publisher.publish's layout_key)."""

    def collect(self, state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, Placement]]:
        """This rank's part of `state_dict`: (local tensors, placements). A piece another rank
        owns is handed in empty, declaring its tensor."""
        locals_ = {name: local_tensor(t) for name, t in state_dict.items()}
        placements = {name: placement_of(t) for name, t in state_dict.items()}
        keys = {name: _piece_key(name, locals_[name], placements[name]) for name in state_dict}
        mine = tuple(sorted(keys.values()))
        if _any_rank(mine != self._keys):
            self._exchange(mine)
        tensors, out = {}, {}
        for name, local in locals_.items():
            if keys[name] in self._owned:
                tensors[name], out[name] = local, placements[name]
            else:
                tensors[name], out[name] = local.reshape(-1)[:0], _empty(placements[name])
        return tensors, out

    def _exchange(self, mine: tuple[str, ...]) -> None:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        owner: dict[str, int] = {}
        for rank, keys in enumerate(everyone):
            for key in keys:
                owner.setdefault(key, rank)
        rank = dist.get_rank()
        self._keys = mine
        self._owned = frozenset(key for key in mine if owner[key] == rank)
        self.layout_key = xxh3_hex(repr(everyone).encode())


def _any_rank(flag: bool) -> bool:
    """True on every rank if it is True on any (one small collective)."""
    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(flag))
    return any(flags)
