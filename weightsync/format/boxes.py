"""boxes: where elements sit in a tensor when they are not one flat range (manifest format 3).

A *box* is per-dimension offsets and sizes in a tensor of some shape: the elements whose index on
every dim d lies in [offsets[d], offsets[d] + sizes[d]), taken in row-major order within the box.
A tensor-parallel shard is one (a row-parallel weight holds a column block: `Shard(1)`), an FSDP
shard of it another, an expert of a fused expert tensor a third. A rank's piece of a tensor is a
list of boxes in the order of its local tensor's elements; each chunk of that piece is one box.

Readers scatter a box chunk into the global tensor's buffer through a strided view (`box_view`),
so nothing needs the piece's other boxes or the whole tensor at once. `cover_error` checks that
boxes cover a tensor exactly once, for a manifest's parser and for the sharded commit, with a
message that names the box at fault.

Not here: flat ranges and the manifest that lists chunks (`manifest.py`), where a publisher cuts
its pieces into chunks (`chunking.py`).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

MAX_GRID_CELLS = 1 << 24
"""The most cells a tensor's boxes may cut it into (the product over dims of the distinct box
edges): what the exact-cover check allocates one byte each for. A publisher's pieces come from a
few splits per dim (shards, then chunk cuts), far below it; docs/format.md, "Limits"."""


@dataclasses.dataclass(frozen=True)
class Box:
    """Elements [offsets[d], offsets[d] + sizes[d]) on every dim d of a tensor, row-major inside."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if len(self.offsets) != len(self.sizes):
            raise ValueError(f"a box needs one offset per size, got offsets {self.offsets} and sizes {self.sizes}")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.sizes):
            raise ValueError(f"box offsets and sizes must be non-negative, got {self}")

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def stops(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=True))

    def fits(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.sizes) and all(stop <= dim for stop, dim in zip(self.stops, shape, strict=True))

    def contains(self, point: Sequence[int]) -> bool:
        return all(o <= p < stop for o, p, stop in zip(self.offsets, point, self.stops, strict=True))

    def to_json(self) -> list[list[int]]:
        return [list(self.offsets), list(self.sizes)]

    def __str__(self) -> str:
        return f"box(offsets={list(self.offsets)}, sizes={list(self.sizes)})"


def box_from_json(doc: Any) -> Box:
    """A box from its manifest form [offsets, sizes]; ValueError if it is not one."""
    if not (isinstance(doc, list) and len(doc) == 2 and all(isinstance(part, list) for part in doc)):
        raise ValueError(f"a box is [offsets, sizes], two lists of integers; got {doc!r}")
    for part in doc:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in part):
            raise ValueError(f"box offsets and sizes must be integers, got {doc!r}")
    return Box(tuple(doc[0]), tuple(doc[1]))


def box_view(buffer: np.ndarray, shape: Sequence[int], itemsize: int, box: Box) -> np.ndarray:
    """The bytes of `box` inside `buffer` (a tensor of `shape`, flat uint8): a strided view of
    shape (*box.sizes, itemsize), row-major like the box's elements."""
    grid = buffer.reshape(*shape, itemsize)
    return grid[tuple(slice(o, stop) for o, stop in zip(box.offsets, box.stops, strict=True))]


def cover_error(shape: Sequence[int], boxes: Sequence[Box], owners: Sequence[str] | None = None) -> str | None:
    """Why `boxes` do not cover a tensor of `shape` exactly once (None: they do): a box outside
    the tensor, two that overlap, or the first box of the tensor that none covers. `owners[i]`
    names who wrote box i (a rank), for the message."""

    def who(i: int) -> str:
        return f" ({owners[i]})" if owners is not None else ""

    for i, box in enumerate(boxes):
        if not box.fits(shape) or box.numel == 0:
            return f"{box}{who(i)} is empty or outside the shape {list(shape)}"
    if math.prod(shape) == 0:
        return None if not boxes else f"{boxes[0]}{who(0)} lies in an empty tensor"
    edges = [
        sorted({0, dim, *(b.offsets[d] for b in boxes), *(b.stops[d] for b in boxes)}) for d, dim in enumerate(shape)
    ]
    cells = math.prod(len(e) - 1 for e in edges)
    if cells > MAX_GRID_CELLS:
        return f"its {len(boxes)} boxes cut it into {cells} cells, over the limit of {MAX_GRID_CELLS}"
    covered = np.zeros([len(e) - 1 for e in edges], dtype=np.bool_)
    for i, box in enumerate(boxes):
        where = tuple(
            slice(bisect.bisect_left(e, o), bisect.bisect_left(e, stop))
            for e, o, stop in zip(edges, box.offsets, box.stops, strict=True)
        )
        if covered[where].any():
            cell = np.argwhere(covered[where])[0]
            corner = [e[w.start + c] for e, w, c in zip(edges, where, cell, strict=True)]
            j = next(j for j in range(i) if boxes[j].contains(corner))
            return f"{box}{who(i)} overlaps {boxes[j]}{who(j)} (an element covered twice)"
        covered[where] = True
    if not covered.all():
        return f"{_hole(covered, edges)} is covered by no chunk (a hole)"
    return None


def _hole(covered: np.ndarray, edges: list[list[int]]) -> Box:
    """The first uncovered cell, grown dim by dim while the cells beside it are uncovered too:
    what a missing piece looks like (a rank's whole block, not one cell of it)."""
    lo = [int(c) for c in np.argwhere(~covered)[0]]
    hi = [c + 1 for c in lo]
    for d in range(covered.ndim):
        while hi[d] < covered.shape[d]:
            beside = tuple(slice(lo[k], hi[k]) if k != d else slice(hi[d], hi[d] + 1) for k in range(covered.ndim))
            if covered[beside].any():
                break
            hi[d] += 1
    return Box(
        tuple(edges[d][lo[d]] for d in range(len(lo))), tuple(edges[d][hi[d]] - edges[d][lo[d]] for d in range(len(lo)))
    )
