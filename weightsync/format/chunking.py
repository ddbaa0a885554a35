"""chunking: where a publisher cuts a tensor into chunks (docs/format.md, note 11).

A chunk is the unit of encoding, hashing, storage, transfer and retry; readers accept any cut
that covers the tensor, so this is the publisher's rule, not a reader's. Chunks are contiguous
element ranges of the bytes a rank holds, at most `chunk_bytes` each.

A tensor of 3 or more dims is cut at its dim-0 slices too: fused MoE experts (experts x rows x
cols, as torchtitan's grouped experts and transformers 5 hold them in memory) then get chunks
that each lie in one expert, so an expert that did not change is `same` chunks and costs
nothing, as a per-expert tensor does. Slices smaller than a chunk are grouped whole; larger ones
are cut into near-equal parts. A dim-0 shard starts at a slice boundary, so the same holds for
each rank's part.

A piece given as boxes (manifest format 3: a tensor- or expert-parallel shard, `boxes.py`) is
cut box by box, each chunk one sub-box in the piece's element order: a box that fits a chunk is
one; a larger one is cut at the outermost dim whose slices fit (near-equal runs of whole slices,
each prefix of the dims before it on its own), the same slice rule in box form.

Not here: encoding a chunk (`chunk.py`), the manifest that lists them (`manifest.py`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from weightsync.format.boxes import Box


def chunk_ranges(itemsize: int, shape: tuple[int, ...], chunk_bytes: int) -> list[tuple[int, int]]:
    """The [start, stop) element ranges of a tensor's chunks, at most `chunk_bytes` each."""
    count = math.prod(shape)
    per_chunk = max(1, chunk_bytes // itemsize)
    if len(shape) < 3 or shape[0] < 2 or count == 0:
        return [(start, min(start + per_chunk, count)) for start in range(0, count, per_chunk)]
    per_slice = count // shape[0]
    if per_slice <= per_chunk:
        step = per_chunk // per_slice * per_slice
        return [(start, min(start + step, count)) for start in range(0, count, step)]
    parts = -(-per_slice // per_chunk)
    return [
        (first + per_slice * i // parts, first + per_slice * (i + 1) // parts)
        for first in range(0, count, per_slice)
        for i in range(parts)
    ]


def box_chunks(boxes: Sequence[Box], itemsize: int, chunk_bytes: int) -> list[tuple[int, int, Box]]:
    """The chunks of a piece made of `boxes` (in the order of its local elements): (local start,
    local stop, the chunk's box in the global tensor), at most `chunk_bytes` each."""
    per_chunk = max(1, chunk_bytes // itemsize)
    chunks, at = [], 0
    for box in boxes:
        for part in cut_box(box, per_chunk):
            chunks.append((at, at + part.numel, part))
            at += part.numel
    return chunks


def cut_box(box: Box, per_chunk: int) -> list[Box]:
    """`box` cut into sub-boxes of at most `per_chunk` elements, in its row-major order."""
    sizes, dims = box.sizes, len(box.sizes)
    if box.numel == 0:
        return []
    if box.numel <= per_chunk:
        return [box]
    cut = next(d for d in range(dims) if math.prod(sizes[d + 1 :]) <= per_chunk)
    step = per_chunk // math.prod(sizes[cut + 1 :])  # indices of dim `cut` per chunk, >= 1
    parts = -(-sizes[cut] // step)
    bounds = [sizes[cut] * i // parts for i in range(parts + 1)]
    out = []
    for prefix in itertools.product(*(range(s) for s in sizes[:cut])):
        for lo, hi in itertools.pairwise(bounds):
            offsets = (
                *(o + i for o, i in zip(box.offsets, prefix, strict=False)),
                box.offsets[cut] + lo,
                *box.offsets[cut + 1 :],
            )
            out.append(Box(offsets, (*(1 for _ in prefix), hi - lo, *sizes[cut + 1 :])))
    return out
