"""Golden bytes: the chunk header layout and the canonical manifest encoding are frozen by
docs/format.md; these tests fail if either drifts.

The zstd frames inside payloads come from the zstandard library: if an upgrade changes them,
the pinned object hashes below change while the headers and the decoded bytes do not. Then
check that old objects still decode (the `test_old_object_still_decodes` test does) and update
the pinned hashes in the same commit as the upgrade.
"""

from __future__ import annotations

import numpy as np
import torch

from weightsync.chunk import HEADER, apply_chunk, encode_chunk, object_hash, unpack_chunk
from weightsync.dtypes import dtype_by_name
from weightsync.manifest import ChunkRef, Manifest, TensorEntry, compute_digest, parse_manifest
from weightsync.tensors import raw_bytes

BF16 = dtype_by_name("bfloat16")
VALUES = [0.0, -0.0, 1.0, -1.5, 3.140625, float("inf"), 1e-40, 65504.0]
RAW_HEX = "00000080803fc0bf4940807f01008047"
RAW_XXH3 = "f061486d5558d2791f748d20218e0565"
# A sparse delta object (one element changed by one bit), byte for byte.
SPARSE_OBJECT_HEX = (
    "5753434b01000301010040000000000008000000000000005f00000000000000"
    "f061486d5558d2791f748d20218e0565f8d356521506bebc3ac6cb30221c61a1"
    "0401000000000000000a000000000000000000000000000000000000000000000001000000000000000a00000000"
    "00000001000000000000000a0000000000000028b52ffd20010900000228b52ffd20010900000128b52ffd200109000000"
)
FULL_OBJECT_XXH3 = "1fb5135330e45b9eaa251920cb0fef44"


def _raw() -> np.ndarray:
    return raw_bytes(torch.tensor(VALUES, dtype=torch.bfloat16))


def test_raw_bytes_are_little_endian_bit_patterns():
    assert _raw().tobytes().hex() == RAW_HEX


def test_full_chunk_header_field_by_field():
    codec_id, raw_hex, obj, changed = encode_chunk(_raw(), None, BF16, 1)
    fields = HEADER.unpack_from(obj, 0)
    magic, fmt, codec, level, dtype_code, flags, header_size, count, payload_len, raw_h, payload_h = fields
    assert (magic, fmt, codec, level, dtype_code, flags, header_size) == (b"WSCK", 1, 1, 1, 1, 0, 64)
    assert (count, payload_len, len(obj)) == (8, len(obj) - 64, 131)
    assert raw_h.hex() == raw_hex == RAW_XXH3
    assert (codec_id, changed) == (1, 8)
    assert obj[12:16] == b"\0\0\0\0"  # reserved
    assert object_hash(obj) == FULL_OBJECT_XXH3


def test_sparse_delta_object_bytes():
    old = _raw().copy()
    old.view(np.uint16)[2] ^= 1
    codec_id, raw_hex, obj, changed = encode_chunk(_raw(), old, BF16, 1)
    assert (codec_id, changed, raw_hex) == (3, 1, RAW_XXH3)
    assert obj.hex() == SPARSE_OBJECT_HEX


def test_old_object_still_decodes():
    old = _raw().copy()
    old.view(np.uint16)[2] ^= 1
    apply_chunk(bytes.fromhex(SPARSE_OBJECT_HEX), old, BF16, RAW_XXH3, 3)
    assert np.array_equal(old, _raw())
    header, payload = unpack_chunk(bytes.fromhex(SPARSE_OBJECT_HEX))
    assert header.count == 8 and len(payload) == 95


GOLDEN_MANIFEST = (
    b'{"base":1,"created_unix_ms":1764000000000,"digest":"DIGEST","format":1,"kind":"delta",'
    b'"model":"org/tiny","parent":1,"producer":{"name":"weightsync","version":"0.1.0"},'
    b'"stats":{"changed_elements":1,"total_elements":9},"step":7,"tensors":['
    b'{"chunks":[{"codec":"sparse","key":"chunks/1f/1fb5135330e45b9eaa251920cb0fef44",'
    b'"object":"1fb5135330e45b9eaa251920cb0fef44","raw":"f061486d5558d2791f748d20218e0565","size":131,'
    b'"start":0,"stop":8}],"dtype":"bfloat16","name":"a.weight","shape":[2,4]},'
    b'{"chunks":[{"codec":"same","raw":"00000000000000000000000000000001","start":0,"stop":1}],'
    b'"dtype":"int64","name":"b.step","shape":[]}],"version":2}'
)
GOLDEN_DIGEST = "0794999e4c25a0a470ef03e5265b4fa5"


def _golden_manifest() -> Manifest:
    tensors = (
        TensorEntry(name="a.weight", dtype="bfloat16", shape=(2, 4), chunks=(ChunkRef(
            start=0, stop=8, codec="sparse", raw=RAW_XXH3, object=FULL_OBJECT_XXH3,
            key=f"chunks/1f/{FULL_OBJECT_XXH3}", size=131),)),
        TensorEntry(name="b.step", dtype="int64", shape=(), chunks=(
            ChunkRef(start=0, stop=1, codec="same", raw="0" * 31 + "1"),)),
    )
    return Manifest(
        model="org/tiny", version=2, parent=1, base=1, kind="delta", step=7, created_unix_ms=1764000000000,
        tensors=tensors, digest=compute_digest(tensors), producer={"name": "weightsync", "version": "0.1.0"},
        stats={"changed_elements": 1, "total_elements": 9},
    )


def test_manifest_canonical_bytes_and_digest():
    manifest = _golden_manifest()
    assert manifest.digest == GOLDEN_DIGEST
    data = manifest.to_bytes()
    assert data == GOLDEN_MANIFEST.replace(b"DIGEST", GOLDEN_DIGEST.encode())
    assert parse_manifest(data) == manifest
