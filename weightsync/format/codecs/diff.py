"""diff: the changes of a tensor's chunks (the change model), found where the tensors live (GPU or CPU).

When the new weights and their parent are both on an accelerator, scanning them there is far
cheaper than copying both to the host and scanning there: the device compares every element,
computes each changed element's class and its rank within the class (everything the per-element
pass of `changes.find_changes` computes), and only the changed elements cross to the host, with
a few integers per chunk. The host then only codes them (`ctx.emit` or `rans.emit`).

A whole tensor is diffed at once, every chunk of it in the same kernels, and its results cross
to the host in one copy: the time on a GPU goes into memory traffic, not into kernel launches
and host round trips per chunk (those had capped a 1 GiB model in 4 MiB chunks at 3.7 GB/s on
an H100).

Written with device-agnostic torch, so the very same code runs (and is tested) on CPU tensors;
its result is identical, field for field, to the host scan's of each chunk.

Not here: the coding itself (`ctx.py`, `rans.py`), which chunks a tensor has (`format/chunking.py`).
"""

from __future__ import annotations

import numpy as np
import torch

from weightsync.format.codecs import changes as change_model
from weightsync.format.dtypes import DType

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # same-width views torch can shift
_NC = change_model.NUM_CLASSES

# Block length of the per-class counts (`_class_stats`): a changed element's rank adds the counts
# of the blocks before its own to those of its class earlier in its block, read for it alone.
_RANK_BLOCK = 256  # below 2^15: a block's counts are int16
_WITHIN_BYTES = 1 << 26
"""Bytes of each temporary for the in-block counts of the changed elements (a block read per
element): in batches, so a slab where many elements changed (lr 1e-5: 10 % or more) does not
need gigabytes at once on the trainer's GPU."""


def diff_chunk(new: torch.Tensor, old: torch.Tensor, dtype: DType) -> change_model.Changes:
    """The changes of flat tensor `new` against `old` (same dtype, shape and device), as one chunk.

    Returns host-side `Changes` for `ctx.emit` / `rans.emit` (via `encode_chunk(..., changes=...)`).
    """
    _check_alike(new, old)
    count = new.numel()
    if count == 0:
        counts = np.full(2 * _NC, -1, dtype=np.int64)
        counts[:_NC] = 0
        empty = np.empty(0, dtype=np.int64)
        return change_model.Changes(
            count=0,
            class_base=0,
            positions=empty,
            classes=empty,
            ranks=empty,
            old_bits=empty.view(np.uint64),
            new_bits=empty.view(np.uint64),
            class_counts=counts,
        )
    return diff_ranges(new, old, [(0, count)], dtype)[0]


def diff_ranges(
    new: torch.Tensor, old: torch.Tensor, ranges: list[tuple[int, int]], dtype: DType
) -> dict[int, change_model.Changes]:
    """{start: changes} of each chunk [start, stop) of flat tensors `new` against `old`.

    `ranges` are the tensor's chunks in order: contiguous, non-empty, covering it exactly (as
    the publisher cuts them). Each result is what `diff_chunk` gives for that chunk alone.
    Consecutive chunks are diffed together in slabs of up to `slab_elements(device)` elements.
    """
    _check_alike(new, old)
    count = new.numel()
    starts = np.array([s for s, _ in ranges], dtype=np.int64)
    stops = np.array([e for _, e in ranges], dtype=np.int64)
    if (
        len(ranges) == 0
        or starts[0] != 0
        or stops[-1] != count
        or np.any(stops <= starts)
        or np.any(starts[1:] != stops[:-1])
    ):
        raise ValueError(f"diff_ranges needs contiguous, non-empty ranges covering all {count} elements")
    nb = new.reshape(-1).view(_BITS[dtype.itemsize])
    ob = old.reshape(-1).view(_BITS[dtype.itemsize])
    result: dict[int, change_model.Changes] = {}
    limit = slab_elements(new.device)
    first = 0
    while first < len(ranges):
        last = first + 1  # a slab: whole chunks, at least one, up to `limit` elements
        while last < len(ranges) and stops[last] - starts[first] <= limit:
            last += 1
        at = int(starts[first])
        end = int(stops[last - 1])
        found = _diff_slab(nb[at:end], ob[at:end], starts[first:last] - at, stops[first:last] - at, dtype)
        result.update((int(start) + at, changes) for start, changes in zip(starts[first:last] - at, found, strict=True))
        first = last
    return result


SLAB_ELEMENTS = {"cpu": 1 << 21}
"""Elements diffed together, by device type (others: `SLAB_ELEMENTS_DEFAULT`). A slab's
temporaries cost ~10 bytes per element: on a CPU, slabs that stay in cache are several times
faster than streaming whole tensors through memory (and fresh pages are slow to touch); on a
GPU, larger slabs mean fewer kernel launches, and the bound keeps a huge tensor's temporaries
(an embedding of a billion elements) off the trainer's memory."""
SLAB_ELEMENTS_DEFAULT = 1 << 27


def slab_elements(device: torch.device) -> int:
    return SLAB_ELEMENTS.get(device.type, SLAB_ELEMENTS_DEFAULT)


def _diff_slab(
    nb: torch.Tensor, ob: torch.Tensor, starts: np.ndarray, stops: np.ndarray, dtype: DType
) -> list[change_model.Changes]:
    """The changes of chunks [starts[i], stops[i]) of the bit patterns `nb` against `ob`, which
    they cover exactly: the device kernels for all of them, then one copy to the host."""
    device, count, chunks = nb.device, nb.numel(), len(starts)
    positions = torch.nonzero(nb != ob).reshape(-1)  # the one wait on the device before the copy
    starts_d = torch.from_numpy(starts).to(device)
    home = torch.searchsorted(starts_d, positions, right=True) - 1  # each change's chunk
    local = positions - starts_d[home]
    layout = change_model.float_layout(dtype.name)
    if layout is None:  # one class: an element's rank is its position in the chunk
        class_base = torch.zeros(chunks, dtype=torch.int64, device=device)
        classes, ranks = torch.zeros_like(local), local
        counts = torch.full((chunks, 2 * _NC), -1, dtype=torch.int64, device=device)
        counts[:, 1:_NC] = 0
        counts[:, 0] = torch.from_numpy(stops - starts).to(device)
        counts[:, _NC] = 0
    else:
        mant, exp_bits = layout
        exponents = (ob >> mant) & ((1 << exp_bits) - 1)  # the shifted-in sign bits are masked off
        if dtype.itemsize == 1:
            exponents = exponents.to(torch.int16)  # room for the subtraction below
        class_base = _class_bases(exponents, starts, stops)
        # Each element's chunk base, as a scan of the bases' steps at the chunk starts (CUDA's
        # repeat_interleave writes each chunk's run from one thread).
        steps = torch.zeros(count, dtype=exponents.dtype, device=device)
        steps[starts_d] = torch.diff(class_base, prepend=class_base.new_zeros(1)).to(exponents.dtype)
        base_of = steps.cumsum(0, dtype=exponents.dtype)
        cls = exponents.sub_(base_of).clamp_(0, _NC - 1).to(torch.uint8)
        del exponents, base_of, steps
        classes = cls[positions].long()
        ranks, counts = _class_stats(cls, positions, classes, home, starts_d, int(stops[-1]))
    # Widened on the device to what `ctx.emit` and `rans.emit` read (int64, and uint64 bit patterns), so
    # the host takes views of one pinned buffer. Widening on the host instead (numpy, one thread,
    # fresh pages) took a third of the diff's time at 1.3 % changed and two thirds at 10 % (1 GiB
    # on an H100: 9.5 -> 14 GB/s and 1.4 -> 4.2 GB/s); the 3x wider copy costs a few ms.
    fields = _to_host(
        {
            "class_base": class_base.to(torch.int64),
            "counts": counts.to(torch.int64),
            "first_change": torch.searchsorted(positions, starts_d),  # of each chunk, in `positions`
            "positions": local.to(torch.int64),
            "ranks": ranks.to(torch.int64),
            "classes": classes.to(torch.int64),
            "old_bits": _unsigned_wide(ob[positions]),
            "new_bits": _unsigned_wide(nb[positions]),
        }
    )
    wide = {name: fields[name] for name in ("positions", "classes", "ranks")}
    wide.update((name, fields[name].view(np.uint64)) for name in ("old_bits", "new_bits"))
    bounds = np.append(fields["first_change"], len(positions))
    counts_of = fields["counts"].reshape(chunks, 2 * _NC)
    return [
        change_model.Changes(
            count=int(stops[i] - starts[i]),
            class_base=int(fields["class_base"][i]),
            **{name: array[bounds[i] : bounds[i + 1]] for name, array in wide.items()},
            class_counts=counts_of[i].copy(),
        )
        for i in range(chunks)
    ]


def _unsigned_wide(bits: torch.Tensor) -> torch.Tensor:
    """Bit patterns as int64 holding their unsigned value (the bytes of a uint64): torch widens
    its signed views with the sign, so the bits above the pattern's width are masked off."""
    wide = bits.to(torch.int64)
    width = 8 * bits.element_size()
    return wide if width == 64 else wide.bitwise_and_((1 << width) - 1)


def _check_alike(new: torch.Tensor, old: torch.Tensor) -> None:
    if new.shape != old.shape or new.dtype != old.dtype or new.device != old.device:
        raise ValueError(
            f"diff needs tensors alike: {new.shape}/{new.dtype}/{new.device} against "
            f"{old.shape}/{old.dtype}/{old.device}"
        )


def _class_bases(exponents: torch.Tensor, starts: np.ndarray, stops: np.ndarray) -> torch.Tensor:
    """`changes.choose_class_base` of every chunk on the device: the same sample of each (every
    `sample_step`-th element from its start), its smallest nonzero exponent, 0 if none."""
    picks = [
        np.arange(s, e, change_model.sample_step(int(e - s)), dtype=np.int64)
        for s, e in zip(starts, stops, strict=True)
    ]
    owner = np.repeat(np.arange(len(picks), dtype=np.int64), [len(p) for p in picks])
    device = exponents.device
    sample = exponents[torch.from_numpy(np.concatenate(picks)).to(device)].long()
    none = 1 << 62
    sample = torch.where(sample > 0, sample, torch.full_like(sample, none))  # zeros and subnormals: any base
    bases = torch.full((len(picks),), none, dtype=torch.int64, device=device)
    bases.scatter_reduce_(0, torch.from_numpy(owner).to(device), sample, reduce="amin")
    return torch.where(bases == none, torch.zeros_like(bases), bases)


def _class_stats(
    cls: torch.Tensor,
    positions: torch.Tensor,
    classes: torch.Tensor,
    home: torch.Tensor,
    starts: torch.Tensor,
    end: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(each changed element's index among its chunk's elements of its class; per chunk, its
    elements per class, then each class's first position in the chunk or -1), in a few wide
    kernels, no sort: per-class counts of blocks of _RANK_BLOCK elements, summed over the blocks
    before a position (`before`), plus those of its class earlier in its own block. A chunk's
    counts are `before` its stop (the next chunk's start, or `end`) minus `before` its start; a
    class's first element in a chunk is the class's element number `before(start)` in the whole
    tensor, found by a binary search over the blocks' running counts and then in its block."""
    block, device = _RANK_BLOCK, cls.device
    count = cls.numel()
    blocks = count // block + 1  # one more: a position at the very end has a block too
    padded = torch.full((blocks * block,), _NC, dtype=torch.uint8, device=device)  # pad: no class
    padded[:count] = cls
    rows = padded.view(blocks, block)
    # Class by class: narrow temporaries, no atomics, no wait on the device. (torch.bincount over
    # block x class cells is as fast on a CPU, but on CUDA it keeps a partial histogram per
    # thread block: gigabytes to zero and sum for this many cells.)
    # Summed as bytes into int16 (a block holds at most 2^15 - 1 elements): a bool sum widens every
    # element to int64 first, 8x the CPU time.
    by_class = torch.stack(
        [(rows == c).view(torch.uint8).sum(1, dtype=torch.int16) for c in range(_NC)]
    )  # [class, block]
    # Running counts along each class's row, as one flat scan less the rows before: a scan along
    # the long axis of a [block, class] tensor runs one thread per class on CUDA (184 ms for a
    # 64 MiB tensor on an H200), a flat one is a single parallel scan.
    flat = by_class.reshape(-1).cumsum(0, dtype=torch.int64).view(_NC, blocks)
    running = flat - torch.cat([flat.new_zeros(1), flat[:-1, -1]]).unsqueeze(1)  # up to each block's end
    before_block = running - by_class

    in_block = torch.arange(block, device=device)

    def before(at: torch.Tensor, of_class: torch.Tensor) -> torch.Tensor:
        """Elements of class `of_class` at positions below `at` (same shapes)."""
        b, offset = at // block, at % block
        flat_b, flat_offset = b.reshape(-1), offset.reshape(-1)
        flat_class = of_class.reshape(-1).to(torch.uint8)  # uint8 like the rows: no widened copy of them
        within = torch.empty(flat_b.shape, dtype=torch.int16, device=device)
        step = max(1, _WITHIN_BYTES // block)  # positions at a time: their blocks are read whole
        for lo in range(0, flat_b.numel(), step):
            hi = lo + step
            earlier = in_block < flat_offset[lo:hi].unsqueeze(-1)
            same = rows[flat_b[lo:hi]] == flat_class[lo:hi].unsqueeze(-1)
            within[lo:hi] = (same & earlier).view(torch.uint8).sum(-1, dtype=torch.int16)
        return before_block[of_class, b] + within.view(at.shape)

    ids = torch.arange(_NC, device=device)
    bounds = torch.cat([starts, starts.new_full((1,), end)])  # every chunk's start, then the end
    at_bound = before(bounds.unsqueeze(1).expand(-1, _NC), ids.unsqueeze(0).expand(len(bounds), -1))
    at_start = at_bound[:-1]  # [chunk, class]
    ranks = before(positions, classes) - at_start[home, classes]
    per_class = at_bound[1:] - at_start
    # A class's first element in a chunk: number at_start of that class in the whole tensor.
    found = torch.searchsorted(running, at_start.t().contiguous(), right=True).t()
    found = found.clamp_(max=blocks - 1)  # [chunk, class]; meaningful where per_class > 0
    nth = at_start - before_block[ids, found]  # 0-based, within its block
    hits = (rows[found] == ids.view(1, _NC, 1)).cumsum(-1)  # [chunk, class, block]
    first = found * block + (hits > nth.unsqueeze(-1)).to(torch.int8).argmax(-1)
    first = torch.where(per_class > 0, first - starts.unsqueeze(1), torch.full_like(first, -1))
    return ranks, torch.cat([per_class, first], dim=1)


def _to_host(fields: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The tensors as host arrays, through one device-to-host copy of their bytes together."""
    views = [t.contiguous().reshape(-1).view(torch.uint8) for t in fields.values()]
    joined = torch.cat(views)
    if joined.device.type == "cpu":
        host = joined.numpy()
    else:  # into pinned memory: a copy to pageable memory is staged, ~10x slower
        pinned = torch.empty(joined.shape, dtype=torch.uint8, pin_memory=True)
        host = pinned.copy_(joined).numpy()
    out, at = {}, 0
    for (name, t), v in zip(fields.items(), views, strict=True):
        n = v.numel()
        out[name] = host[at : at + n].view(_numpy_dtype(t.dtype))
        at += n
    return out


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype({torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}[dtype])


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
    ) -> dict[str, dict[int, change_model.Changes]]:
        """{tensor name: {chunk start: changes}}. `planned`: name -> (dtype, shape) the snapshot
        will hold (`tensors.snapshot_layout`); `ranges_of(name)` gives the (start, stop) element
        ranges of the local tensor that the publisher encodes."""
        from weightsync.format.tensors import dtype_of  # tensors imports nothing from here; kept local for clarity

        usable = parent is not None and parent == self._version
        found: dict[str, dict[int, change_model.Changes]] = {}
        for name, tensor in state_dict.items():
            dtype, _ = planned[name]
            if dtype_of(tensor) != dtype:  # cast by the snapshot: the device bits are not the published ones
                self._tensors.pop(name, None)
                continue
            flat = tensor.detach().reshape(-1)
            kept = self._tensors.get(name)
            if usable and kept is not None and kept.shape == flat.shape and kept.device == flat.device:
                ranges = ranges_of(name)
                if ranges:
                    found[name] = diff_ranges(flat, kept, ranges, dtype)
                kept.copy_(flat)
            else:
                self._tensors[name] = flat.clone()
        self._version = version
        return found
