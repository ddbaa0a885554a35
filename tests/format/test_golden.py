"""Golden bytes: the chunk object layout (docs/format.md, "Chunk objects") and the canonical
manifest encoding and version digest (docs/format.md, "Manifest") are frozen; these tests fail if
any of them drifts.

What to do when a test here fails after a dependency upgrade:
- Header fields, raw bytes, stream tables, manifest bytes and digests never depend on zstd: a
  change there is a format change (bump a format version, update docs/format.md), not a fix.
- The zstd frames inside payloads come from the zstandard library. If a zstandard upgrade changes
  them, the pinned payload/object hashes change while headers and decoded bytes do not: check
  that `test_pinned_objects_still_decode` passes (old objects must stay readable forever), then
  update PAYLOAD_XXH3 / FULL_OBJECT_XXH3 / FULL_OBJECT_HEX / SPARSE_OBJECT_HEX in the same commit
  as the upgrade, saying so in its message. Keep the old hex as a decode-only fixture if it
  differs.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest
import torch
import zstandard

from weightsync.format.boxes import Box
from weightsync.format.chunk import HEADER, HEADER_SIZE, apply_chunk, encode_chunk, object_hash, unpack_chunk
from weightsync.format.codecs import CODEC_CTX, CODEC_FULL, CODEC_RANS, CODEC_SPARSE
from weightsync.format.codecs.choice import CodecChoice
from weightsync.format.dtypes import dtype_by_name
from weightsync.format.hashing import xxh3_digest, xxh3_hex
from weightsync.format.manifest import (
    ChunkRef,
    Manifest,
    TensorEntry,
    canonical_json,
    compute_digest,
    lowest_format,
    parse_manifest,
)
from weightsync.format.tensors import raw_bytes, to_tensor

BF16 = dtype_by_name("bfloat16")
# +0, -0, 1, -1.5, pi (bf16-rounded), +inf, a subnormal (1e-40 -> 0x0001), a large finite value.
VALUES = [0.0, -0.0, 1.0, -1.5, 3.140625, float("inf"), 1e-40, 65504.0]
BITS = [0x0000, 0x8000, 0x3F80, 0xBFC0, 0x4049, 0x7F80, 0x0001, 0x4780]
RAW_HEX = "00000080803fc0bf4940807f01008047"
RAW_XXH3 = "f061486d5558d2791f748d20218e0565"

# The `full` object of VALUES at zstd level 3. Its two 8-byte planes are incompressible, so zstd
# stores them as raw blocks; the hashes below still depend on the zstandard version (see above).
PAYLOAD_XXH3 = "dceadd6943f86999ec12603b7cb1e189"
FULL_OBJECT_XXH3 = "e6d027a2d28b9aa07a29d6af77ac6e3d"
FULL_OBJECT_HEX = (
    "5753434b01000103010040000000000008000000000000004300000000000000"  # header 0..31
    "f061486d5558d2791f748d20218e0565dceadd6943f86999ec12603b7cb1e189"  # header 32..63: raw, payload hashes
    "02"  # two streams
    "08000000000000001100000000000000"
    "08000000000000001100000000000000"  # (raw_len, comp_len) x 2
    "28b52ffd"
    "20"
    "08"
    "410000"
    "000080c049800180"  # zstd magic, descriptor, size 8, raw block: plane 0
    "28b52ffd"
    "20"
    "08"
    "410000"
    "00803fbf407f0047"  # the same for plane 1
)

# A sparse delta object (element 2 differed by its lowest bit from the parent), zstd level 1.
SPARSE_OBJECT_HEX = (
    "5753434b01000301010040000000000008000000000000005f00000000000000"
    "f061486d5558d2791f748d20218e0565f8d356521506bebc3ac6cb30221c61a1"
    "0401000000000000000a000000000000000000000000000000000000000000000001000000000000000a00000000"
    "00000001000000000000000a0000000000000028b52ffd20010900000228b52ffd20010900000128b52ffd200109000000"
)

# A ctx delta object (docs/format.md, "Codec ctx"): 64 bf16 weights around 2^-7, +0, 1.0 and a NaN,
# of which 7 changed: +1 ULP, a negative weight +1 ULP away from zero, -1 ULP, +5 ULP, +0 -> -0,
# a NaN payload and the last element. Nothing in it depends on zstd: these bytes are frozen.
CTX_PARENT_HEX = (
    "00bc253c4a3c1fbc143c393c3ebc033c283c5dbc723c173c7cbc613c063c1bbc503c753c3abc3f3c0000803fc07f533c"
    "78bc1d3c423c17bc0c3c313c36bc7b3c203c55bc6a3c0f3c74bc593c7e3c13bc483c6d3c32bc373c5c3c51bc263c4b3c"
    "70bc153c3a3c0fbc043c293c2ebc733c183c4dbc623c073c6cbc513c763c0bbc"
)
CTX_NEW_HEX = (
    "00bc263c4a3c20bc143c393c3ebc023c283c5dbc773c173c7cbc613c063c1bbc503c753c3abc3f3c0080803fc17f533c"
    "78bc1d3c423c17bc0c3c313c36bc7b3c203c55bc6a3c0f3c74bc593c7e3c13bc483c6d3c32bc373c5c3c51bc263c4b3c"
    "70bc153c3a3c0fbc043c293c2ebc733c183c4dbc623c073c6cbc513c763c0cbc"
)
CTX_RAW_XXH3 = "e7e2a3db24cb6369f72990af667302e5"
CTX_OBJECT_HEX = (
    "5753434b01000401010040000000000040000000000000001800000000000000"  # header: codec 4, 64 elements
    "e7e2a3db24cb6369f72990af667302e568e71178996749419f6534ca421c7de2"
    "0700000000000000"
    "7800"  # 7 changed elements, class base 120 (exponent of 2^-7)
    "00082fdc3c06c7c9236895200000"  # the range coder's bytes (the first is always 0)
)

# The same step as a rans object (docs/format.md, "Codec rans"), which publishers write for chunks
# of >= 4096 changes: classes 0 and 15 have changes; each a varint count, a gap parameter, the gap
# and step alphabet sizes, the step frequencies; then the rANS words and one raw-bit word.
RANS_OBJECT_HEX = (
    "5753434b01000501010040000000000040000000000000003600000000000000"  # header: codec 5, 64 elements
    "e7e2a3db24cb6369f72990af667302e5f3009444b793a69eac90167d3aced77e"
    "0700000000000000"
    "7800"
    "0180"
    "05000000"  # 7 changed, class base 120, classes 0 and 15, 5 words
    "06"
    "1b"
    "0a"
    "07"
    "d502"
    "d60a"
    "00"
    "00"
    "00"
    "00"
    "d502"  # class 0: 6 changes, gamma 27, 10, 7 freqs
    "01"
    "00"
    "01"
    "01"
    "8010"  # class 15: 1 change, gamma 0, one gap symbol, one step symbol of 2048
    "f4b8b50021d91f00b7a2"  # the rANS words: X0, X1, then one more
    "3001000000000000"  # the raw bits
)


def _raw() -> np.ndarray:
    return raw_bytes(torch.tensor(VALUES, dtype=torch.bfloat16))


def test_raw_bytes_are_little_endian_bit_patterns():
    raw = _raw()
    assert raw.tobytes().hex() == RAW_HEX
    assert list(np.frombuffer(raw.tobytes(), "<u2")) == BITS
    assert xxh3_digest(raw).hex() == RAW_XXH3


def test_full_chunk_header_field_by_field():
    codec_id, raw_hex, obj, changed = encode_chunk(_raw(), None, BF16, 3)
    assert (codec_id, raw_hex, changed) == (CODEC_FULL, RAW_XXH3, 8)
    assert HEADER.size == HEADER_SIZE == 64
    assert obj[0:4] == b"WSCK"  # magic
    assert struct.unpack_from("<H", obj, 4) == (1,)  # format version
    assert obj[6] == 1  # codec id: full
    assert obj[7] == 3  # zstd level
    assert obj[8] == 1  # dtype code: bfloat16
    assert obj[9] == 0  # flags
    assert struct.unpack_from("<H", obj, 10) == (64,)  # header size
    assert obj[12:16] == b"\0\0\0\0"  # reserved
    assert struct.unpack_from("<Q", obj, 16) == (8,)  # element count
    assert struct.unpack_from("<Q", obj, 24) == (len(obj) - 64,)  # payload length
    assert obj[32:48] == bytes.fromhex(RAW_XXH3)  # raw xxh3-128, canonical big-endian digest
    assert obj[48:64] == xxh3_digest(obj[64:])  # payload xxh3-128
    assert obj[48:64].hex() == PAYLOAD_XXH3
    assert object_hash(obj) == FULL_OBJECT_XXH3 == xxh3_hex(obj)
    assert obj.hex() == FULL_OBJECT_HEX
    # The same fields through the parser.
    header, payload = unpack_chunk(obj)
    assert (header.codec_id, header.zstd_level, header.dtype, header.count) == (CODEC_FULL, 3, BF16, 8)
    assert (header.payload_bytes, header.raw_xxh3.hex(), header.payload_xxh3.hex()) == (67, RAW_XXH3, PAYLOAD_XXH3)
    assert bytes(payload) == obj[64:]


def test_full_payload_stream_table():
    """The payload's framing (stream count and table) does not depend on zstd; the planes do not either."""
    _, _, obj, _ = encode_chunk(_raw(), None, BF16, 3)
    payload = obj[64:]
    assert payload[0] == 2  # one stream per byte plane of a 2-byte element
    (raw0, comp0), (raw1, comp1) = struct.iter_unpack("<QQ", payload[1:33])
    assert (raw0, raw1) == (8, 8)
    assert 33 + comp0 + comp1 == len(payload)
    frames = payload[33 : 33 + comp0], payload[33 + comp0 :]
    planes = [zstandard.ZstdDecompressor().decompress(f) for f in frames]
    assert planes[0] == bytes(b & 0xFF for b in BITS)  # low bytes (mantissa)
    assert planes[1] == bytes(b >> 8 for b in BITS)  # high bytes (sign, exponent)


def test_sparse_delta_object_bytes():
    old = _raw().copy()
    old.view(np.uint16)[2] ^= 1
    # For readers before codec 4 (ctx would win: it has its own golden object below).
    codec_id, raw_hex, obj, changed = encode_chunk(_raw(), old, BF16, 1, choice=CodecChoice(highest_codec=CODEC_SPARSE))
    assert (codec_id, changed, raw_hex) == (CODEC_SPARSE, 1, RAW_XXH3)
    assert obj.hex() == SPARSE_OBJECT_HEX


def test_ctx_delta_object_bytes():
    parent, new = bytes.fromhex(CTX_PARENT_HEX), bytes.fromhex(CTX_NEW_HEX)
    codec_id, raw_hex, obj, changed = encode_chunk(
        np.frombuffer(new, np.uint8), np.frombuffer(parent, np.uint8), BF16, 1
    )
    assert (codec_id, changed, raw_hex) == (CODEC_CTX, 7, CTX_RAW_XXH3)
    assert obj.hex() == CTX_OBJECT_HEX
    assert struct.unpack_from("<QH", obj, 64) == (7, 120) and obj[74] == 0


def test_rans_delta_object_bytes():
    parent, new = bytes.fromhex(CTX_PARENT_HEX), bytes.fromhex(CTX_NEW_HEX)
    codec_id, raw_hex, obj, changed = encode_chunk(
        np.frombuffer(new, np.uint8), np.frombuffer(parent, np.uint8), BF16, 1, choice=CodecChoice(rans_from_changes=1)
    )
    assert (codec_id, changed, raw_hex) == (CODEC_RANS, 7, CTX_RAW_XXH3)
    assert obj.hex() == RANS_OBJECT_HEX


@pytest.mark.parametrize("which", ["full", "sparse", "ctx", "rans"])
def test_pinned_objects_still_decode(which):
    """Objects written by earlier builds stay readable whatever zstd version wrote them."""
    if which in ("ctx", "rans"):
        out = np.frombuffer(bytes.fromhex(CTX_PARENT_HEX), np.uint8).copy()
        obj, codec_id = (CTX_OBJECT_HEX, CODEC_CTX) if which == "ctx" else (RANS_OBJECT_HEX, CODEC_RANS)
        apply_chunk(bytes.fromhex(obj), out, BF16, CTX_RAW_XXH3, codec_id)
        assert out.tobytes().hex() == CTX_NEW_HEX
        return
    if which == "full":
        obj, out, codec_id = bytes.fromhex(FULL_OBJECT_HEX), np.full(16, 0xEE, np.uint8), CODEC_FULL
    else:
        obj, out, codec_id = bytes.fromhex(SPARSE_OBJECT_HEX), _raw().copy(), CODEC_SPARSE
        out.view(np.uint16)[2] ^= 1
    apply_chunk(obj, out, BF16, RAW_XXH3, codec_id)
    assert out.tobytes().hex() == RAW_HEX
    back = to_tensor(out, BF16, (8,))
    assert torch.equal(back.view(torch.int16), torch.tensor(BITS, dtype=torch.int32).to(torch.int16))


# ------------------------------------------------------------------------------- manifests

OBJ = FULL_OBJECT_XXH3
GOLDEN_FULL_MANIFEST = (
    b'{"base":1,"created_unix_ms":1764000000000,"digest":"60a2b2c2a9aee4d6698a44abbec9c24f","format":1,'
    b'"kind":"full","model":"org/tiny","parent":null,'
    b'"producer":{"host":"golden","name":"weightsync","version":"0.1.0"},'
    b'"stats":{"changed_elements":9,"total_elements":9},"step":null,"tensors":['
    b'{"chunks":[{"codec":"full","key":"chunks/e6/e6d027a2d28b9aa07a29d6af77ac6e3d",'
    b'"object":"e6d027a2d28b9aa07a29d6af77ac6e3d","raw":"f061486d5558d2791f748d20218e0565","size":131,'
    b'"start":0,"stop":8}],"dtype":"bfloat16","name":"a.weight","shape":[2,4]},'
    b'{"chunks":[],"dtype":"float32","name":"b.empty","shape":[0,3]},'
    b'{"chunks":[{"codec":"full","key":"chunks/11/11111111111111111111111111111111",'
    b'"object":"11111111111111111111111111111111","raw":"00000000000000000000000000000001","size":100,'
    b'"start":0,"stop":1}],"dtype":"int64","name":"c.step","shape":[]}],"version":1}'
)
GOLDEN_FULL_DIGEST = "60a2b2c2a9aee4d6698a44abbec9c24f"
GOLDEN_FULL_DIGEST_DOC = (
    b'[["a.weight","bfloat16",[2,4],[[0,8,"f061486d5558d2791f748d20218e0565"]]],["b.empty","float32",[0,3],[]],'
    b'["c.step","int64",[],[[0,1,"00000000000000000000000000000001"]]]]'
)

GOLDEN_DELTA_MANIFEST = (
    b'{"base":1,"created_unix_ms":1764000001234,"digest":"f6775f33b4f51579a9e849aa49bdc41b","format":1,'
    b'"kind":"delta","model":"org/tiny","parent":1,"producer":{"name":"weightsync","version":"0.1.0"},'
    b'"stats":{"changed_elements":3,"total_elements":9},"step":7,"tensors":['
    b'{"chunks":[{"codec":"sparse","key":"chunks/33/33333333333333333333333333333333",'
    b'"object":"33333333333333333333333333333333","raw":"22222222222222222222222222222222","size":95,'
    b'"start":0,"stop":4},{"codec":"same","raw":"44444444444444444444444444444444","start":4,"stop":8}],'
    b'"dtype":"bfloat16","name":"a.weight","shape":[2,4]},'
    b'{"chunks":[],"dtype":"float32","name":"b.empty","shape":[0,3]},'
    b'{"chunks":[{"codec":"xor","key":"chunks/66/66666666666666666666666666666666",'
    b'"object":"66666666666666666666666666666666","raw":"55555555555555555555555555555555","size":90,'
    b'"start":0,"stop":1}],"dtype":"int64","name":"c.step","shape":[]}],"version":2}'
)
# Format 2: the same delta with both stored chunks packed back to back in one pack (docs/format.md, "Packs").
GOLDEN_PACKED_MANIFEST = (
    b'{"base":1,"created_unix_ms":1764000001234,"digest":"f6775f33b4f51579a9e849aa49bdc41b","format":2,'
    b'"kind":"delta","model":"org/tiny","parent":1,"producer":{"name":"weightsync","version":"0.1.0"},'
    b'"stats":{"changed_elements":3,"total_elements":9},"step":7,"tensors":['
    b'{"chunks":[{"codec":"sparse","key":"packs/77/77777777777777777777777777777777",'
    b'"object":"33333333333333333333333333333333","offset":0,"raw":"22222222222222222222222222222222",'
    b'"size":95,"start":0,"stop":4},{"codec":"same","raw":"44444444444444444444444444444444","start":4,"stop":8}],'
    b'"dtype":"bfloat16","name":"a.weight","shape":[2,4]},{"chunks":[],"dtype":"float32","name":"b.empty",'
    b'"shape":[0,3]},{"chunks":[{"codec":"xor","key":"packs/77/77777777777777777777777777777777",'
    b'"object":"66666666666666666666666666666666","offset":95,"raw":"55555555555555555555555555555555",'
    b'"size":90,"start":0,"stop":1}],"dtype":"int64","name":"c.step","shape":[]}],"version":2}'
)
GOLDEN_DELTA_DIGEST = "f6775f33b4f51579a9e849aa49bdc41b"
# Format 3: a [2, 4] weight published as its two column halves (a row-parallel weight's shards over 2
# ranks), each chunk a box (docs/format.md, "Boxes"); its digest entries are [offsets, sizes, raw].
GOLDEN_BOX_MANIFEST = (
    b'{"base":1,"created_unix_ms":1764000000000,"digest":"35deb76d880412739e06246e473ba10b","format":3,'
    b'"kind":"full","model":"org/tiny","parent":null,"producer":{"name":"weightsync","version":"0.1.0"},'
    b'"stats":{},"step":null,"tensors":[{"chunks":[{"box":[[0,0],[2,2]],"codec":"full",'
    b'"key":"chunks/99/99999999999999999999999999999999","object":"99999999999999999999999999999999",'
    b'"raw":"88888888888888888888888888888888","size":80},{"box":[[0,2],[2,2]],"codec":"full",'
    b'"key":"chunks/bb/bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","object":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",'
    b'"raw":"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","size":80}],"dtype":"bfloat16","name":"a.weight","shape":[2,4]}],'
    b'"version":1}'
)
GOLDEN_BOX_DIGEST = "35deb76d880412739e06246e473ba10b"
GOLDEN_BOX_DIGEST_DOC = (
    b'[["a.weight","bfloat16",[2,4],[[[0,0],[2,2],"88888888888888888888888888888888"],'
    b'[[0,2],[2,2],"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]]]]'
)


def _full_manifest() -> Manifest:
    tensors = (
        TensorEntry(
            name="a.weight",
            dtype="bfloat16",
            shape=(2, 4),
            chunks=(
                ChunkRef(start=0, stop=8, codec="full", raw=RAW_XXH3, object=OBJ, key=f"chunks/e6/{OBJ}", size=131),
            ),
        ),
        TensorEntry(name="b.empty", dtype="float32", shape=(0, 3), chunks=()),
        TensorEntry(
            name="c.step",
            dtype="int64",
            shape=(),
            chunks=(
                ChunkRef(
                    start=0,
                    stop=1,
                    codec="full",
                    raw="0" * 31 + "1",
                    object="1" * 32,
                    key="chunks/11/" + "1" * 32,
                    size=100,
                ),
            ),
        ),
    )
    return Manifest(
        model="org/tiny",
        version=1,
        parent=None,
        base=1,
        kind="full",
        step=None,
        created_unix_ms=1764000000000,
        tensors=tensors,
        digest=GOLDEN_FULL_DIGEST,
        producer={"host": "golden", "name": "weightsync", "version": "0.1.0"},
        stats={"changed_elements": 9, "total_elements": 9},
    )


def _delta_manifest() -> Manifest:
    tensors = (
        TensorEntry(
            name="a.weight",
            dtype="bfloat16",
            shape=(2, 4),
            chunks=(
                ChunkRef(
                    start=0, stop=4, codec="sparse", raw="2" * 32, object="3" * 32, key="chunks/33/" + "3" * 32, size=95
                ),
                ChunkRef(start=4, stop=8, codec="same", raw="4" * 32),
            ),
        ),
        TensorEntry(name="b.empty", dtype="float32", shape=(0, 3), chunks=()),
        TensorEntry(
            name="c.step",
            dtype="int64",
            shape=(),
            chunks=(
                ChunkRef(
                    start=0, stop=1, codec="xor", raw="5" * 32, object="6" * 32, key="chunks/66/" + "6" * 32, size=90
                ),
            ),
        ),
    )
    return Manifest(
        model="org/tiny",
        version=2,
        parent=1,
        base=1,
        kind="delta",
        step=7,
        created_unix_ms=1764000001234,
        tensors=tensors,
        digest=GOLDEN_DELTA_DIGEST,
        producer={"name": "weightsync", "version": "0.1.0"},
        stats={"changed_elements": 3, "total_elements": 9},
    )


def _packed_delta_manifest() -> Manifest:
    delta = _delta_manifest()
    pack = "packs/77/" + "7" * 32
    a, empty, c = delta.tensors
    a = dataclasses.replace(a, chunks=(dataclasses.replace(a.chunks[0], key=pack, offset=0), a.chunks[1]))
    c = dataclasses.replace(c, chunks=(dataclasses.replace(c.chunks[0], key=pack, offset=95),))
    return dataclasses.replace(delta, tensors=(a, empty, c), format=2)


def _box_manifest() -> Manifest:
    def half(col: int, raw: str, obj: str) -> ChunkRef:
        return ChunkRef(
            box=Box((0, col), (2, 2)), codec="full", raw=raw, object=obj, key=f"chunks/{obj[:2]}/{obj}", size=80
        )

    tensors = (
        TensorEntry(
            name="a.weight",
            dtype="bfloat16",
            shape=(2, 4),
            chunks=(half(0, "8" * 32, "9" * 32), half(2, "a" * 32, "b" * 32)),
        ),
    )
    producer = {"name": "weightsync", "version": "0.1.0"}
    return dataclasses.replace(
        _full_manifest(), tensors=tensors, digest=GOLDEN_BOX_DIGEST, producer=producer, stats={}, format=3
    )


@pytest.mark.parametrize(
    "build, golden, digest",
    [
        (_full_manifest, GOLDEN_FULL_MANIFEST, GOLDEN_FULL_DIGEST),
        (_delta_manifest, GOLDEN_DELTA_MANIFEST, GOLDEN_DELTA_DIGEST),
        (_packed_delta_manifest, GOLDEN_PACKED_MANIFEST, GOLDEN_DELTA_DIGEST),
        (_box_manifest, GOLDEN_BOX_MANIFEST, GOLDEN_BOX_DIGEST),
    ],
    ids=["full", "delta", "packed-delta", "boxes"],
)
def test_manifest_canonical_bytes_parse_and_digest(build, golden, digest):
    manifest = build()
    assert compute_digest(manifest.tensors) == digest
    assert manifest.to_bytes() == golden
    parsed = parse_manifest(golden)
    assert parsed == manifest
    assert parsed.to_bytes() == golden
    assert parsed.digest == digest


def test_version_digest_is_xxh3_of_the_documented_document():
    """docs/format.md: xxh3-128 of canonical [[name, dtype, shape, [[start, stop, raw], ...]], ...]."""
    manifest = _full_manifest()
    doc = [[t.name, t.dtype, list(t.shape), [[c.start, c.stop, c.raw] for c in t.chunks]] for t in manifest.tensors]
    assert canonical_json(doc) == GOLDEN_FULL_DIGEST_DOC
    assert xxh3_hex(GOLDEN_FULL_DIGEST_DOC) == GOLDEN_FULL_DIGEST


def test_a_box_chunks_digest_entry_is_offsets_sizes_and_raw():
    """docs/format.md, "Version digest": a box chunk enters as [offsets, sizes, raw]."""
    manifest = _box_manifest()
    doc = [[t.name, t.dtype, list(t.shape), [[*c.box.to_json(), c.raw] for c in t.chunks]] for t in manifest.tensors]
    assert canonical_json(doc) == GOLDEN_BOX_DIGEST_DOC
    assert xxh3_hex(GOLDEN_BOX_DIGEST_DOC) == GOLDEN_BOX_DIGEST


def test_older_golden_manifests_stay_in_their_formats():
    """Manifests without packs or boxes are what format-1 readers read, byte for byte; the
    publisher's choice of format is the lowest that holds a version (docs/format.md)."""
    assert lowest_format(_full_manifest().tensors) == 1 and lowest_format(_delta_manifest().tensors) == 1
    assert lowest_format(_packed_delta_manifest().tensors) == 2
    assert lowest_format(_box_manifest().tensors) == 3


def test_digest_ignores_codecs_and_objects():
    """Equal weights and chunking give equal digests, however they were encoded."""
    delta = _delta_manifest()
    recoded = tuple(
        TensorEntry(
            name=t.name,
            dtype=t.dtype,
            shape=t.shape,
            chunks=tuple(
                ChunkRef(
                    start=c.start,
                    stop=c.stop,
                    codec="full",
                    raw=c.raw,
                    object="7" * 32,
                    key="chunks/77/" + "7" * 32,
                    size=1000,
                )
                for c in t.chunks
            ),
        )
        for t in delta.tensors
    )
    assert compute_digest(recoded) == GOLDEN_DELTA_DIGEST
