"""chunk: the self-describing object a chunk is stored and sent as (header + codec payload).

A chunk is a contiguous flat element range [start, stop) of one tensor. Its object is a fixed
64-byte header followed by the codec payload; the object is content-addressed by the xxh3-128
of all its bytes, so a store or a peer can hold it without knowing which version uses it.
Byte layout and rules: docs/format.md, "Chunk objects".

Not here: the codecs themselves and the choice between them (`weightsync.format.codecs`), where an
object is stored (`layout.py`).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import TYPE_CHECKING

import numpy as np

from weightsync.errors import FormatError, IntegrityError, UnsupportedFormatError
from weightsync.format import codecs
from weightsync.format.dtypes import DType, dtype_by_code
from weightsync.format.hashing import xxh3_digest, xxh3_hex

if TYPE_CHECKING:
    from weightsync.format.codecs.changes import Changes
    from weightsync.format.codecs.choice import CodecChoice

CHUNK_MAGIC = b"WSCK"
CHUNK_FORMAT_VERSION = 1  # 1: the only one; codecs are their own axis (ids 1-5, docs/format.md)
SUPPORTED_CHUNK_FORMATS = (1,)
HEADER = struct.Struct("<4sHBBBBHIQQ16s16s")
HEADER_SIZE = HEADER.size  # 64
assert HEADER_SIZE == 64

# Hard limits (docs/format.md, "Limits").
MAX_CHUNK_BYTES = 64 * 1024 * 1024


def max_object_bytes(raw_bytes: int) -> int:
    """The largest object a chunk of `raw_bytes` may be: zstd never expands by more than this."""
    return HEADER_SIZE + raw_bytes + raw_bytes // 16 + 4096


@dataclasses.dataclass(frozen=True)
class ChunkHeader:
    codec_id: int
    zstd_level: int
    dtype: DType
    count: int  # elements
    payload_bytes: int
    raw_xxh3: bytes  # 16 bytes: hash of the chunk's new raw bytes
    payload_xxh3: bytes  # 16 bytes: hash of the payload that follows the header


def pack_chunk(codec_id: int, zstd_level: int, dtype: DType, count: int, raw_xxh3: bytes, payload: bytes) -> bytes:
    """The object bytes of a chunk: header then payload."""
    header = HEADER.pack(
        CHUNK_MAGIC,
        CHUNK_FORMAT_VERSION,
        codec_id,
        zstd_level,
        dtype.code,
        0,  # flags, reserved
        HEADER_SIZE,
        0,  # reserved
        count,
        len(payload),
        raw_xxh3,
        xxh3_digest(payload),
    )
    return header + payload


def unpack_chunk(obj: bytes | memoryview) -> tuple[ChunkHeader, memoryview]:
    """Parses and checks an object's header and payload hash; returns them (payload not decoded)."""
    view = memoryview(obj)
    if len(view) < HEADER_SIZE:
        raise FormatError(f"chunk object of {len(view)} bytes is shorter than its {HEADER_SIZE}-byte header")
    magic, fmt, codec_id, level, dtype_code, flags, header_size, reserved, count, payload_bytes, raw_h, payload_h = (
        HEADER.unpack_from(view, 0)
    )
    if magic != CHUNK_MAGIC:
        raise FormatError(f"not a weightsync chunk (magic {bytes(magic)!r}, expected {CHUNK_MAGIC!r})")
    if fmt not in SUPPORTED_CHUNK_FORMATS:
        raise UnsupportedFormatError(
            f"chunk format version {fmt} is not supported; supported: {list(SUPPORTED_CHUNK_FORMATS)}"
        )
    if header_size != HEADER_SIZE or flags != 0:
        raise FormatError(f"chunk header size {header_size} / flags {flags} not valid for format {fmt}")
    if reserved != 0:
        raise FormatError(f"chunk header's reserved bytes must be zero, got {reserved:#x}")
    if codec_id not in codecs.CODEC_NAMES:
        raise UnsupportedFormatError(f"unknown codec id {codec_id}; supported: {sorted(codecs.CODEC_NAMES)}")
    if level > codecs.MAX_ZSTD_LEVEL:
        raise FormatError(f"zstd level {level} out of range")
    dtype = dtype_by_code(dtype_code)
    if count * dtype.itemsize > MAX_CHUNK_BYTES:
        raise FormatError(f"chunk of {count} x {dtype.itemsize} bytes exceeds the {MAX_CHUNK_BYTES}-byte limit")
    if HEADER_SIZE + payload_bytes != len(view):
        raise FormatError(f"chunk object is {len(view)} bytes but its header declares {HEADER_SIZE + payload_bytes}")
    payload = view[HEADER_SIZE:]
    if xxh3_digest(payload) != payload_h:
        raise IntegrityError("chunk payload does not match the hash in its header")
    return ChunkHeader(codec_id, level, dtype, count, payload_bytes, raw_h, payload_h), payload


def encode_chunk(
    new: np.ndarray,
    old: np.ndarray | None,
    dtype: DType,
    zstd_level: int,
    *,
    changes: Changes | None = None,
    choice: CodecChoice | None = None,
) -> tuple[int, str, bytes | None, int]:
    """Encodes the raw bytes of one chunk, as a delta against `old` when given.

    Returns (codec id, raw hash hex, object bytes or None when unchanged, changed elements).
    An unchanged chunk has no object at all (docs/format.md: codec "same"). `changes`: the
    chunk's changes found on the tensors' device (`weightsync.format.codecs.diff`), optional.
    `choice`: how a delta's codec is chosen, and the highest it may be (default: any).
    """
    raw_digest = xxh3_digest(new)
    count = new.nbytes // dtype.itemsize
    if old is None:
        payload = codecs.encode_full(new, dtype.itemsize, zstd_level)
        codec_id, changed = codecs.CODEC_FULL, count
    else:
        result = codecs.encode_delta(
            new, old, dtype.itemsize, zstd_level, dtype_name=dtype.name, changes=changes, choice=choice
        )
        if result is None:
            return 0, raw_digest.hex(), None, 0
        codec_id, payload, changed = result
    obj = pack_chunk(codec_id, zstd_level, dtype, count, raw_digest, payload)
    return codec_id, raw_digest.hex(), obj, changed


def object_hash(obj: bytes | memoryview) -> str:
    """The content address of a chunk object."""
    return xxh3_hex(obj)


def apply_chunk(
    obj: bytes | memoryview, out: np.ndarray, dtype: DType, expect_raw_xxh3: str, expect_codec_id: int
) -> None:
    """Verifies an object, applies it to `out` (the raw bytes of its range) and checks the result.

    For delta codecs `out` holds the parent's bytes. The raw hash is checked after applying;
    on a mismatch `out` holds garbage and the caller must discard the whole version.
    """
    header, payload = unpack_chunk(obj)
    if header.codec_id != expect_codec_id:
        raise FormatError(
            f"chunk codec {codecs.CODEC_NAMES[header.codec_id]} differs from the manifest's "
            f"{codecs.CODEC_NAMES.get(expect_codec_id, expect_codec_id)}"
        )
    if header.dtype != dtype:
        raise FormatError(f"chunk dtype {header.dtype.name} does not match tensor dtype {dtype.name}")
    if header.count * dtype.itemsize != out.nbytes:
        raise FormatError(f"chunk holds {header.count} elements, its range {out.nbytes // dtype.itemsize}")
    if header.raw_xxh3.hex() != expect_raw_xxh3:
        raise IntegrityError("chunk header's raw hash differs from the manifest's")
    codecs.decode_into(header.codec_id, payload, out, dtype.itemsize, dtype_name=dtype.name)
    if xxh3_digest(out) != header.raw_xxh3:
        raise IntegrityError("chunk decoded to bytes whose hash differs from the published one")
