"""elements: a chunk's raw bytes as unsigned words, and the per-thread work arrays codecs reuse.

Every codec sees a chunk as `count` little-endian unsigned integers of `itemsize` bytes (the bit
patterns, never numbers). `uint_view` is that view, without a copy; `scratch` hands a thread the
same work array again on its next call, because fresh allocations (and the page faults of
touching them) halved codec throughput.

Not here: any codec (`planes.py`, `ctx.py`, `rans.py`), the change model (`changes.py`).
"""

from __future__ import annotations

import threading

import numpy as np

from weightsync.errors import UnsupportedFormatError

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
"""The unsigned word of each element width the codecs support."""

_local = threading.local()
_MIN_SCRATCH_BYTES = 1 << 16  # small requests share one buffer that later, larger ones grow


def uint_view(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """The bytes of a chunk as unsigned integers of `itemsize` bytes (no copy)."""
    if itemsize not in UINT:
        raise UnsupportedFormatError(f"itemsize {itemsize} not supported; supported: {sorted(UINT)}")
    return raw.view(UINT[itemsize])


def scratch(name: str, count: int, dtype=np.uint8) -> np.ndarray:
    """`count` elements of `dtype` in this thread's reusable buffer `name` (contents undefined).

    Valid until this thread asks for `name` again; a name belongs to one use in one module, so
    two arrays alive at once never share a buffer.
    """
    nbytes = count * np.dtype(dtype).itemsize
    buf = _local.__dict__.get(name)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, _MIN_SCRATCH_BYTES), dtype=np.uint8)
        _local.__dict__[name] = buf
    return buf[:nbytes].view(dtype)
