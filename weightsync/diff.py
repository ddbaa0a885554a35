"""diff: a chunk's changes for codec `ctx`, found where the tensors live (GPU or CPU).

When the new weights and their parent are both on an accelerator, scanning them there is far
cheaper than copying both to the host and scanning there: the device compares every element,
computes each changed element's class and its rank within the class (everything the per-element
pass of `ctx_codec.scan_changes` computes), and only the changed elements cross to the host, with
32 per-class integers. The host then only range-codes them (`ctx_codec.emit`).

Written with device-agnostic torch, so the very same code runs (and is tested) on CPU tensors;
its result is identical, field for field, to the host scan's.

Not here: the coding itself (`ctx_codec.py`), which chunks a tensor has (`publisher.py`).
"""

from __future__ import annotations

import numpy as np
import torch

from weightsync import ctx_codec
from weightsync.dtypes import DType

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width views torch can shift
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def diff_chunk(new: torch.Tensor, old: torch.Tensor, dtype: DType) -> ctx_codec.Changes:
    """The changes of flat tensor `new` against `old` (same dtype, shape and device).

    Returns host-side `Changes` for `ctx_codec.emit` (via `encode_chunk(..., changes=...)`).
    """
    if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
        raise ValueError(f"diff_chunk needs tensors alike: {new.shape}/{new.dtype}/{new.device} against "
                         f"{old.shape}/{old.dtype}/{old.device}")
    itemsize = dtype.itemsize
    nb = new.reshape(-1).view(_BITS[itemsize])
    ob = old.reshape(-1).view(_BITS[itemsize])
    count = nb.numel()
    positions = torch.nonzero(nb != ob).reshape(-1)
    layout = ctx_codec.float_layout(dtype.name)
    counts = torch.zeros(2 * ctx_codec.NUM_CLASSES, dtype=torch.int64)
    if layout is None or count == 0:  # one class: the rank of an element is its position
        class_base = 0
        classes = torch.zeros_like(positions)
        ranks = positions
        counts[0] = count
        counts[ctx_codec.NUM_CLASSES :] = -1
        if count:
            counts[ctx_codec.NUM_CLASSES] = 0
    else:
        mant, exp_bits = layout
        wide = torch.int64 if itemsize == 8 else torch.int32
        exponents = (ob.to(wide) >> mant) & ((1 << exp_bits) - 1)
        class_base = _class_base(exponents)
        cls = (exponents - class_base).clamp_(0, ctx_codec.NUM_CLASSES - 1)
        classes = cls[positions].long()
        ranks, per_class, first = _class_stats(cls, positions, classes)
        counts = torch.cat([per_class, first])
    old_bits, new_bits = ob[positions], nb[positions]
    # Narrow on the device, widen on the host: 13 bytes per changed bf16 element cross, not 40.
    return ctx_codec.Changes(
        count=count,
        class_base=class_base,
        positions=_host(positions.to(torch.int32), np.int64),
        classes=_host(classes.to(torch.uint8), np.int64),
        ranks=_host(ranks.to(torch.int32), np.int64),
        old_bits=_host_bits(old_bits, itemsize),
        new_bits=_host_bits(new_bits, itemsize),
        class_counts=_host(counts, np.int64),
    )


# Block length of the per-class counts (`_ranks_in_class`).
_RANK_BLOCK = 256


def _class_stats(cls: torch.Tensor, positions: torch.Tensor, classes: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each changed element's index among the chunk's elements of its class, elements per
    class, each class's first position or -1), in a few wide kernels with no sort and no atomics
    on a handful of cells: per-class counts of each block of _RANK_BLOCK elements, summed over the
    blocks before a changed element, plus the elements of its class before it in its own block
    (read for the changed elements only)."""
    n_classes, block = ctx_codec.NUM_CLASSES, _RANK_BLOCK
    device = cls.device
    count = cls.numel()
    blocks = -(-count // block)
    padded = torch.full((blocks * block,), n_classes, dtype=torch.int64, device=device)  # pad: no class
    padded[:count] = cls
    cells = torch.arange(blocks * block, device=device) // block * (n_classes + 1) + padded
    table = torch.zeros(blocks * (n_classes + 1), dtype=torch.int64, device=device)
    table.scatter_add_(0, cells, torch.ones_like(cells))
    by_class = table.view(blocks, n_classes + 1)[:, :n_classes].t().contiguous()  # [class, block]
    before_block = by_class.cumsum(1) - by_class  # exclusive: a class's count in the blocks before
    home, offset = positions // block, positions % block
    rows = padded.view(blocks, block)[home]  # the changed elements' own blocks
    earlier = torch.arange(block, device=device).unsqueeze(0) < offset.unsqueeze(1)
    within = ((rows == classes.unsqueeze(1)) & earlier).sum(1)
    ranks = before_block[classes, home] + within
    per_class = by_class.sum(1)
    # A class's first position: its first block with any element, then the first one in it.
    first_block = (by_class > 0).to(torch.int8).argmax(1)
    ids = torch.arange(n_classes, device=device).unsqueeze(1)
    first = first_block * block + (padded.view(blocks, block)[first_block] == ids).to(torch.int8).argmax(1)
    first = torch.where(per_class > 0, first, torch.full_like(first, -1))
    return ranks, per_class, first


def _class_base(exponents: torch.Tensor) -> int:
    """`ctx_codec.choose_class_base` on the device: the same sample, its smallest nonzero exponent."""
    sample = exponents[:: ctx_codec.sample_step(exponents.numel())]
    sample = sample[sample > 0]
    if sample.numel() == 0:
        return 0
    return int(sample.min())


def _host(t: torch.Tensor, np_dtype) -> np.ndarray:
    return t.cpu().numpy().astype(np_dtype, copy=False)


def _host_bits(t: torch.Tensor, itemsize: int) -> np.ndarray:
    """Bit patterns as uint64 (the signed view's bits, not its values)."""
    return t.cpu().numpy().view(_UINT[itemsize]).astype(np.uint64)


class DeviceParent:
    """The last published weights, kept where the trainer's tensors live, to diff the next ones
    there (the publisher's `device_diff` option). Costs one copy of those tensors on their device.

    `diff` is called once per publish, in publish order: it returns the changes of every chunk
    of every tensor it can diff against the version the new one is a delta of, and then keeps
    the new weights as the parent of the next publish. It diffs only when its copy *is* that
    parent (same version, dtype and shape) and the snapshot holds the tensor's own bits (no
    cast), so its changes always describe exactly the bytes the host encodes against.
    """

    def __init__(self) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._version: int | None = None

    def diff(
        self, state_dict, planned, version: int, parent: int | None, ranges_of
    ) -> dict[str, dict[int, ctx_codec.Changes]]:
        """{tensor name: {chunk start: changes}}. `planned`: name -> (dtype, shape) the snapshot
        will hold (`tensors.snapshot_layout`); `ranges_of(dtype, shape)` gives the (start, stop)
        element ranges the publisher encodes."""
        from weightsync.tensors import dtype_of  # tensors imports nothing from here; kept local for clarity

        usable = parent is not None and parent == self._version
        found: dict[str, dict[int, ctx_codec.Changes]] = {}
        for name, tensor in state_dict.items():
            dtype, shape = planned[name]
            if dtype_of(tensor) != dtype:  # cast by the snapshot: the device bits are not the published ones
                self._tensors.pop(name, None)
                continue
            flat = tensor.detach().reshape(-1)
            kept = self._tensors.get(name)
            if usable and kept is not None and kept.shape == flat.shape and kept.device == flat.device:
                found[name] = {
                    start: diff_chunk(flat[start:stop], kept[start:stop], dtype)
                    for start, stop in ranges_of(dtype, shape)
                }
                kept.copy_(flat)
            else:
                self._tensors[name] = flat.clone()
        self._version = version
        return found
