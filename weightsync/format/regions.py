"""regions: a chunk's bytes inside its tensor's buffer, for readers that apply and hash in place.

A reader holds each tensor as one flat uint8 buffer. A flat chunk [start, stop) is a slice of it;
a box chunk (manifest format 3) is a strided view, whose bytes the codecs cannot work on in place:
they are gathered into a contiguous copy of the chunk's size, decoded there, and scattered back.
Either way a caller sees the chunk's raw bytes in the chunk's own element order, and the extra
memory is one chunk at a time, never a tensor.

Not here: decoding (`chunk.py`, `codecs/`), the geometry of boxes (`boxes.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from weightsync.format.boxes import box_view
from weightsync.format.dtypes import dtype_by_name
from weightsync.format.manifest import ChunkRef, TensorEntry


def read_region(buffer: np.ndarray, tensor: TensorEntry, ref: ChunkRef) -> np.ndarray:
    """The chunk's bytes, flat: a view of `buffer` where they are contiguous, else a copy."""
    itemsize = dtype_by_name(tensor.dtype).itemsize
    if ref.box is None:
        return buffer[ref.start * itemsize : ref.stop * itemsize]
    return np.ascontiguousarray(box_view(buffer, tensor.shape, itemsize, ref.box)).reshape(-1)


@contextlib.contextmanager
def writable_region(buffer: np.ndarray, tensor: TensorEntry, ref: ChunkRef) -> Iterator[np.ndarray]:
    """The chunk's bytes, flat and writable; what the caller writes there is in `buffer` once the
    block ends without an exception (after one, a box chunk's part of `buffer` is unchanged)."""
    itemsize = dtype_by_name(tensor.dtype).itemsize
    if ref.box is None:
        yield buffer[ref.start * itemsize : ref.stop * itemsize]
        return
    view = box_view(buffer, tensor.shape, itemsize, ref.box)
    if view.flags.c_contiguous:  # whole trailing dims: the box is a slice after all
        yield view.reshape(-1)
        return
    data = np.ascontiguousarray(view).reshape(-1)
    yield data
    view[...] = data.reshape(view.shape)
