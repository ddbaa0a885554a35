"""codec: one chunk's raw bit patterns to a compressed payload and back, bit for bit.

A chunk is `count` elements of `itemsize` bytes, seen as little-endian unsigned integers (the
bit patterns; a codec never interprets them as numbers, so NaN payloads, -0.0 and subnormals
survive untouched). Five codecs, ids fixed by docs/format.md:

- `full` (1): byte planes of the raw bits, each plane a zstd frame. Needs no parent.
- `xor` (2): byte planes of (new XOR parent), zstd. Dense; wins when many elements changed.
- `sparse` (3): the positions of changed elements as gaps (one byte each, 255 escaping to a
  u32 overflow stream) and the XOR of their bit patterns as byte planes, each stream its own
  zstd frame. The fallback where `ctx` is not smaller.
- `ctx` (4): the change mask per exponent class and each change as an integer step, range-coded
  under contexts from the parent's bits (`ctx_codec.py`). Wins at RL change rates (1-20 % of
  elements changed): ~1.4-1.5x smaller than `sparse`.
- `rans` (5): ctx's model under static per-chunk tables, coded by rANS (`rans_codec.py`): the
  same size within ~0.5 % on big chunks, decoded ~1.5x faster. Chunks with at least
  RANS_MIN_CHANGES changes get it; smaller ones keep ctx, whose adaptive cells need no tables.

Byte planes matter because the high byte of a bf16 (sign + exponent) is far more predictable
than the low byte (mantissa); zstd's entropy stage sees each plane's own statistics.

Not here: chunk headers and hashes (`chunk.py`), which chunks a version has (`publisher.py`).
"""

from __future__ import annotations

import logging
import struct
import sys
import threading
from collections.abc import Iterable

import numpy as np
import zstandard

from weightsync.cpus import lower_this_thread_priority
from weightsync.errors import FormatError, UnsupportedFormatError
from weightsync.format.codecs import ctx as ctx_codec
from weightsync.format.codecs import rans as rans_codec

log = logging.getLogger(__name__)

if sys.byteorder != "little":  # the planes are defined on little-endian bit patterns
    raise ImportError("weightsync supports little-endian hosts only")

CODEC_FULL = 1
CODEC_XOR = 2
CODEC_SPARSE = 3
CODEC_CTX = 4
CODEC_RANS = 5
CODEC_NAMES = {CODEC_FULL: "full", CODEC_XOR: "xor", CODEC_SPARSE: "sparse", CODEC_CTX: "ctx", CODEC_RANS: "rans"}
CODEC_IDS = {name: codec_id for codec_id, name in CODEC_NAMES.items()}

DEFAULT_ZSTD_LEVEL = 1
MAX_ZSTD_LEVEL = 22
_GAP_ESCAPE = 255
_STREAM_ENTRY = struct.Struct("<QQ")  # raw length, compressed length

# Sparse wins clearly below SPARSE_DENSITY and dense XOR above DENSE_DENSITY (measured on
# bf16 RL checkpoints); in between both are tried and the smaller payload is kept.
SPARSE_DENSITY = 0.20
DENSE_DENSITY = 0.40
# `ctx` is tried first up to CTX_DENSITY (its coder runs once per changed element, so it gets
# slow where most elements change, and xor wins there anyway). 0 turns it off (objects that
# readers older than codec 4 can decode).
CTX_DENSITY = 0.20
# Where ctx applies, chunks with at least this many changes are coded `rans` instead: its tables
# (~10-20 bytes per exponent class) cost what ctx's learning does at ~4k changes (measured on bf16
# RL deltas: +0.2 % in all at this threshold, +1 % with every chunk rans), and its decoder is
# ~1.5x faster. 0 turns it off (objects that readers older than codec 5 can decode).
RANS_MIN_CHANGES = 4096

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """zstd tuned for planes and streams of weight bits (one per thread: not thread-safe).

    These streams are nearly match-free (skewed symbols, not repeated strings), so short matches
    only get in the way of zstd's entropy coder: a 7-byte minimum match is both smaller and
    faster at every level (measured on bf16 RL deltas: value planes -14 %, full planes -20 %
    and 2-3x faster than stock level 3). Level 1 also uses the fast strategy with tiny tables.
    """
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        if level <= 1:
            params = zstandard.ZstdCompressionParameters.from_level(
                1, strategy=zstandard.STRATEGY_FAST, min_match=7, hash_log=8, search_log=1, write_content_size=True
            )
        else:
            params = zstandard.ZstdCompressionParameters.from_level(level, min_match=7, write_content_size=True)
        cache[level] = zstandard.ZstdCompressor(compression_params=params)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def _scratch(name: str, nbytes: int) -> np.ndarray:
    """A per-thread reusable byte buffer: fresh allocations halve codec throughput."""
    buf = _local.__dict__.get(name)
    if buf is None or buf.nbytes < nbytes:
        buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
        _local.__dict__[name] = buf
    return buf[:nbytes]


def uint_view(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """The bytes of a chunk as unsigned integers of `itemsize` bytes (no copy)."""
    if itemsize not in _UINT:
        raise UnsupportedFormatError(f"itemsize {itemsize} not supported; supported: 1, 2, 4, 8")
    return raw.view(_UINT[itemsize])


# ---------------------------------------------------------------------------------- streams


def _pack_streams(streams: list[np.ndarray | bytes], compressor: zstandard.ZstdCompressor) -> bytes:
    frames = [compressor.compress(s) if len(s) else b"" for s in streams]
    table = b"".join(_STREAM_ENTRY.pack(memoryview(s).nbytes, len(f)) for s, f in zip(streams, frames, strict=True))
    return b"".join([bytes([len(streams)]), table, *frames])


def _unpack_streams(payload: bytes | memoryview, expected_raw_lens: list[int | range]) -> list[bytes]:
    """Splits and decompresses the streams of a payload, refusing anything off-spec.

    `expected_raw_lens[i]` is the length stream i must decompress to, or a range of allowed
    lengths when only a bound is known. A frame is never allowed to allocate more than that: its
    declared content size is checked before decompressing (the zstd-bomb defence).
    """
    view = memoryview(payload)
    if len(view) < 1:
        raise FormatError("codec payload is empty")
    n = view[0]
    if n != len(expected_raw_lens):
        raise FormatError(f"codec payload has {n} streams, expected {len(expected_raw_lens)}")
    table_end = 1 + n * _STREAM_ENTRY.size
    if len(view) < table_end:
        raise FormatError("codec payload truncated in its stream table")
    out = []
    offset = table_end
    for i, expected in enumerate(expected_raw_lens):
        raw_len, comp_len = _STREAM_ENTRY.unpack_from(view, 1 + i * _STREAM_ENTRY.size)
        if raw_len not in (expected if isinstance(expected, range) else (expected,)):
            raise FormatError(f"stream {i} declares {raw_len} bytes, expected {expected}")
        if offset + comp_len > len(view):
            raise FormatError(f"stream {i} truncated: needs {comp_len} bytes, {len(view) - offset} left")
        frame = view[offset : offset + comp_len]
        offset += comp_len
        if raw_len == 0:
            if comp_len != 0:
                raise FormatError(f"stream {i} is empty but carries {comp_len} compressed bytes")
            out.append(b"")
            continue
        out.append(_decompress_exact(frame, raw_len, i))
    if offset != len(view):
        raise FormatError(f"codec payload has {len(view) - offset} trailing bytes")
    return out


def _decompress_exact(frame: memoryview, raw_len: int, stream: int) -> bytes:
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise FormatError(f"stream {stream}: not a zstd frame ({e})") from None
    if declared not in (-1, raw_len):
        raise FormatError(f"stream {stream}: zstd frame claims {declared} bytes, expected {raw_len}")
    try:
        data = _decompressor().decompress(frame, max_output_size=raw_len, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise FormatError(f"stream {stream}: corrupt zstd frame ({e})") from None
    if len(data) != raw_len:
        raise FormatError(f"stream {stream}: decompressed to {len(data)} bytes, expected {raw_len}")
    return data


# ----------------------------------------------------------------------------------- planes


def _planes(values: np.ndarray, itemsize: int) -> list[np.ndarray]:
    """Byte k of every element, for k = 0 (least significant) .. itemsize - 1.

    Shift-and-truncate ufuncs run 2.5x faster than strided column copies.
    """
    if itemsize == 1:
        return [values.view(np.uint8)]
    words = uint_view(values.view(np.uint8), itemsize)
    planes = [np.empty(len(words), dtype=np.uint8) for _ in range(itemsize)]
    np.copyto(planes[0], words, casting="unsafe")  # the cast keeps the low byte
    for k in range(1, itemsize):
        np.right_shift(words, 8 * k, out=planes[k], casting="unsafe")
    return planes


def _join_planes(planes: list[bytes], out: np.ndarray, itemsize: int, xor: bool) -> None:
    """Writes (or XORs) planes back into the raw bytes `out` of the chunk."""
    columns = [np.frombuffer(p, dtype=np.uint8) for p in planes]
    if itemsize == 1:
        if xor:
            np.bitwise_xor(out, columns[0], out=out)
        else:
            out[:] = columns[0]
        return
    utype = _UINT[itemsize]
    target = uint_view(out, itemsize)
    words = uint_view(_scratch("join", out.nbytes), itemsize) if xor else target
    shifted = uint_view(_scratch("shift", out.nbytes), itemsize)
    np.copyto(words, columns[0])
    for k in range(1, itemsize):
        np.left_shift(columns[k], 8 * k, out=shifted, dtype=utype)
        np.bitwise_or(words, shifted, out=words)
    if xor:
        np.bitwise_xor(target, words, out=target)


# ----------------------------------------------------------------------------------- encode


def encode_full(raw: np.ndarray, itemsize: int, level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    """Payload of the `full` codec for the raw bytes of a chunk."""
    return _pack_streams(_planes(raw, itemsize), _compressor(level))


def encode_delta(
    new: np.ndarray,
    old: np.ndarray,
    itemsize: int,
    level: int = DEFAULT_ZSTD_LEVEL,
    *,
    dtype_name: str | None = None,
    changes: ctx_codec.Changes | None = None,
) -> tuple[int, bytes, int] | None:
    """Encodes `new` against `old` (raw bytes of the same range); None if they are equal.

    Returns (codec id, payload, number of changed elements). The codec is chosen per chunk by
    the fraction of changed elements: `ctx` up to CTX_DENSITY unless `sparse` would be smaller
    (it checks that cheaply: `ctx` gives up past a bound), then `sparse` and `xor` as before,
    trying both where neither is a clear winner. `dtype_name` gives `ctx` its exponent contexts
    (None: the bits are coded as integers, still lossless). `changes` are the changes already
    found on the tensors' device (`weightsync.format.codecs.diff`), which saves the host its scan.
    """
    if new.nbytes != old.nbytes:
        raise ValueError(f"new has {new.nbytes} bytes, old {old.nbytes}")
    count = new.nbytes // itemsize
    dtype_name = dtype_name or f"uint{8 * itemsize}"
    if changes is not None and not _describes(changes, new, old, itemsize):
        raise ValueError("the device changes do not describe these bytes (a parent out of step?)")
    if changes is not None and len(changes.positions) / max(count, 1) <= CTX_DENSITY:
        if len(changes.positions) == 0:
            return None
        coded = _emit_modelled(changes, dtype_name, itemsize)
        if coded is not None:
            return *coded, len(changes.positions)
    if changes is None and CTX_DENSITY > 0:
        # ctx's own scan counts the changes too, giving up past CTX_DENSITY: at RL change rates
        # this is the only pass over the chunk (the XOR below took as long as the scan).
        changes = ctx_codec.find_changes(new, old, dtype_name, itemsize, _ctx_capacity(count))
        if changes is not None:
            if len(changes.positions) == 0:
                return None
            coded = _emit_modelled(changes, dtype_name, itemsize)
            if coded is not None:
                return *coded, len(changes.positions)
    x = uint_view(_scratch("xor", new.nbytes), itemsize)
    np.bitwise_xor(uint_view(new, itemsize), uint_view(old, itemsize), out=x)
    positions = _changed_positions(x, itemsize)
    changed = len(positions)
    if changed == 0:
        return None
    density = changed / count
    candidates = []
    if density <= DENSE_DENSITY:
        candidates.append((CODEC_SPARSE, _encode_sparse(x, positions, itemsize, _compressor(level))))
    if density > SPARSE_DENSITY:
        candidates.append((CODEC_XOR, _pack_streams(_planes(x, itemsize), _compressor(level))))
    codec_id, payload = min(candidates, key=lambda c: len(c[1]))
    return codec_id, payload, changed


_KERNEL_MODULES = (ctx_codec, rans_codec)  # the codecs with numba kernels, each with its own warm_up


def warm_up(dtype_names: Iterable[str]) -> None:
    """Compiles (or loads from numba's cache) the ctx and rans kernels for these dtypes' element
    widths: a process that must not pay the first compile inside a latency it measures calls this."""
    names = list(dtype_names)
    for kernels in _KERNEL_MODULES:
        kernels.warm_up(names)


class BackgroundWarmUp:
    """`warm_up` in a low-priority daemon thread, for a long-lived process (a publisher, an agent)
    to compile the kernels while it waits for its first delta: on a machine whose numba cache is
    empty (a new pod), that delta would otherwise compile them itself (~13 s of one CPU on the
    2-core machine; loading them once cached takes ~0.1 s). A delta that needs a kernel meanwhile
    waits for numba's compile lock; on a saturated machine that wait can exceed compiling the
    kernel itself, as the warm-up also compiles kernels this process may not need (docs/agents.md).
    A failure is logged, not raised: the first delta compiles what this could not.

    It compiles one codec and element width at a time, so that `close()` (which the owner calls
    before its process exits: a compile that the exit cuts short can crash it) waits for the one
    under way, not for the rest: at low priority on a busy machine the whole set can take minutes,
    and a short-lived process need not pay for kernels it will never use."""

    CLOSE_TIMEOUT_S = 300.0

    def __init__(self, dtype_names: Iterable[str], *, thread_name: str) -> None:
        self.dtype_names = sorted(set(dtype_names))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lower_this_thread_priority()
        for name in self.dtype_names:
            for kernels in _KERNEL_MODULES:
                if self._stop.is_set():
                    return
                try:
                    kernels.warm_up([name])
                except Exception:  # noqa: BLE001 -- only a head start (see above)
                    log.warning("warming up the %s kernels for %s failed", kernels.__name__, name, exc_info=True)

    def wait(self, timeout: float | None = None) -> bool:
        """True once every kernel is compiled (or the warm-up was stopped)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Compiles nothing after the kernel under way."""
        self._stop.set()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops, and waits for the compile under way."""
        self.stop()
        if not self.wait(timeout):
            log.warning("the codec warm-up (%s) is still compiling after %.0f s", self._thread.name, timeout)


def _emit_modelled(changes: ctx_codec.Changes, dtype_name: str, itemsize: int) -> tuple[int, bytes] | None:
    """(codec id, payload) in `rans` or `ctx` for the changes the scan found, or None when it
    would be larger than `sparse` may be (random bits, where no context helps)."""
    changed = len(changes.positions)
    limit = _ctx_limit(changed, itemsize)
    if RANS_MIN_CHANGES and changed >= RANS_MIN_CHANGES:
        payload = rans_codec.emit(changes, dtype_name, itemsize, limit)
        return None if payload is None else (CODEC_RANS, payload)
    payload = ctx_codec.emit(changes, dtype_name, itemsize, limit)
    return None if payload is None else (CODEC_CTX, payload)


def _describes(changes: ctx_codec.Changes, new: np.ndarray, old: np.ndarray, itemsize: int) -> bool:
    """A cheap check (changed elements only) that device changes belong to these host bytes."""
    count = new.nbytes // itemsize
    if changes.count != count:
        return False
    positions = changes.positions
    return bool(
        np.array_equal(uint_view(new, itemsize)[positions], changes.new_bits)
        and np.array_equal(uint_view(old, itemsize)[positions], changes.old_bits)
    )


def _ctx_capacity(count: int) -> int:
    """The most changed elements of `count` for which ctx is tried: changed / count <= CTX_DENSITY,
    exactly as the float division decides it."""
    capacity = int(CTX_DENSITY * count)
    while capacity < count and (capacity + 1) / count <= CTX_DENSITY:
        capacity += 1
    while capacity > 0 and capacity / count > CTX_DENSITY:
        capacity -= 1
    return capacity


def _ctx_limit(changed: int, itemsize: int) -> int:
    """The `ctx` payload size past which `sparse` is worth trying instead: the half of one gap
    byte and the value bytes per change (sparse after zstd, on the data where ctx does worst:
    random bits, where no context helps)."""
    return changed * (itemsize + 1) // 2 + 1024


def _changed_positions(x: np.ndarray, itemsize: int) -> np.ndarray:
    """Indices of the nonzero elements of `x`, in order.

    Scans 8-byte words first: at RL change rates most words are zero, so only the few nonzero
    words are gathered and split into elements. ~4x faster than np.flatnonzero on the elements.
    """
    per_word = 8 // itemsize
    whole = (len(x) // per_word) * per_word
    if per_word == 1 or whole == 0:
        return np.flatnonzero(x)
    words = np.flatnonzero(x[:whole].view(np.uint64) != 0)  # a bool mask first is 2x faster
    lanes = np.flatnonzero(x[:whole].view(np.uint64)[words].view(x.dtype) != 0)
    positions = words[lanes // per_word] * per_word + lanes % per_word
    if whole < len(x):
        positions = np.concatenate([positions, np.flatnonzero(x[whole:]) + whole])
    return positions


def _encode_sparse(x: np.ndarray, positions: np.ndarray, itemsize: int, compressor: zstandard.ZstdCompressor) -> bytes:
    gaps = np.diff(positions, prepend=-1)
    gaps -= 1
    gap_bytes = np.minimum(gaps, _GAP_ESCAPE).astype(np.uint8)
    # Long gaps: (gap - 255) as u32, stored as its 4 byte planes one after the other (the high
    # planes are nearly all zero and vanish under zstd).
    overflow = np.concatenate(_planes((gaps[gaps >= _GAP_ESCAPE] - _GAP_ESCAPE).astype(np.uint32), 4))
    values = x[positions]
    return _pack_streams([gap_bytes, overflow, *_planes(values, itemsize)], compressor)


# ----------------------------------------------------------------------------------- decode


def decode_into(
    codec_id: int, payload: bytes | memoryview, out: np.ndarray, itemsize: int, *, dtype_name: str | None = None
) -> None:
    """Applies a payload to the raw bytes `out` of its chunk range, in place.

    `full` overwrites `out`; `xor`, `sparse`, `ctx` and `rans` apply to it, so `out` must hold the
    parent's bytes of the same range (`ctx` and `rans` need the same `dtype_name` as their encoder). Raises
    FormatError on any malformed payload, before writing when the fault is in the framing (a
    corrupt frame or ctx stream is detected before any byte is applied).
    """
    if out.nbytes % itemsize:
        raise FormatError(f"chunk of {out.nbytes} bytes is not a whole number of {itemsize}-byte elements")
    count = out.nbytes // itemsize
    if codec_id == CODEC_FULL:
        _join_planes(_unpack_streams(payload, [count] * itemsize), out, itemsize, xor=False)
    elif codec_id == CODEC_XOR:
        _join_planes(_unpack_streams(payload, [count] * itemsize), out, itemsize, xor=True)
    elif codec_id == CODEC_SPARSE:
        _decode_sparse(payload, out, itemsize, count)
    elif codec_id == CODEC_CTX:
        ctx_codec.decode_into(payload, out, dtype_name or f"uint{8 * itemsize}", itemsize)
    elif codec_id == CODEC_RANS:
        rans_codec.decode_into(payload, out, dtype_name or f"uint{8 * itemsize}", itemsize)
    else:
        raise UnsupportedFormatError(f"unknown codec id {codec_id}; supported: {sorted(CODEC_NAMES)}")


def _decode_sparse(payload: bytes | memoryview, out: np.ndarray, itemsize: int, count: int) -> None:
    view = memoryview(payload)
    if len(view) < 1 + _STREAM_ENTRY.size:
        raise FormatError("sparse payload truncated")
    changed, _ = _STREAM_ENTRY.unpack_from(view, 1)
    if changed > count:
        raise FormatError(f"sparse payload claims {changed} changed elements in a chunk of {count}")
    # The overflow stream's exact length depends on the gap bytes: bound it now (4 bytes per
    # changed element at most), check it exactly once they are decoded.
    streams = _unpack_streams(view, [changed, range(4 * changed + 1)] + [changed] * itemsize)
    gap_bytes = np.frombuffer(streams[0], dtype=np.uint8)
    escaped = gap_bytes == _GAP_ESCAPE
    n_overflow = int(np.count_nonzero(escaped))
    if len(streams[1]) != 4 * n_overflow:
        raise FormatError(f"sparse overflow stream has {len(streams[1])} bytes, expected {4 * n_overflow}")
    if changed == 0:
        return
    gaps = gap_bytes.astype(np.int64)
    if n_overflow:
        overflow = np.empty(n_overflow, dtype=np.uint32)
        planes = [streams[1][k * n_overflow : (k + 1) * n_overflow] for k in range(4)]
        _join_planes(planes, overflow.view(np.uint8), 4, xor=False)
        gaps[escaped] = overflow.astype(np.int64) + _GAP_ESCAPE
    positions = np.cumsum(gaps + 1) - 1
    if positions[-1] >= count:
        raise FormatError(f"sparse position {int(positions[-1])} is outside the chunk of {count} elements")
    values = np.empty(changed, dtype=_UINT[itemsize])
    _join_planes(streams[2:], values.view(np.uint8), itemsize, xor=False)
    target = uint_view(out, itemsize)
    target[positions] ^= values
