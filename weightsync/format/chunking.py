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

Not here: encoding a chunk (`chunk.py`), the manifest that lists them (`manifest.py`).
"""

from __future__ import annotations

import math


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
