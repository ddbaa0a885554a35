"""Writes the hostile-input corpus next to this file: malformed manifests and chunk objects, and
`expected.json`, which says for each file the error class it must raise, a fragment of the
message, and (for chunks) how to apply it and at which stage it must fail.

Deterministic (fixed seeds, fixed zstd parameters): run `python tests/hostile/make_hostile.py`
after a format change and commit the result. Every file stays under 100 KB; inputs that must be
big (a manifest over MAX_MANIFEST_BYTES, nesting near the interpreter's recursion limit) are
built by tests/format/test_hostile.py at test time instead. tests/format/test_hostile.py checks every file
listed here and that nothing else is in the folder.

Chunk entries in expected.json:
  dtype, count, codec, raw   what the (pretend) manifest says: apply_chunk's arguments
  parent_seed                the bytes the output range holds before applying (see `parent`)
  stage                      "unpack": unpack_chunk itself refuses the object;
                             "apply": unpack_chunk accepts it and apply_chunk refuses it
  touches                    true only where the failure is detected after decoding into the
                             range (a raw-hash mismatch); otherwise the range must be unchanged
"""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path

import numpy as np
import zstandard

from weightsync.format.boxes import Box
from weightsync.format.chunk import HEADER, encode_chunk
from weightsync.format.codecs import CODEC_CTX, CODEC_FULL, CODEC_IDS, CODEC_NAMES, CODEC_RANS, CODEC_SPARSE, CODEC_XOR
from weightsync.format.codecs import rans as rans_codec
from weightsync.format.codecs.choice import CodecChoice
from weightsync.format.dtypes import dtype_by_name
from weightsync.format.hashing import xxh3_digest
from weightsync.format.layout import chunk_key, pack_key
from weightsync.format.manifest import (
    CODEC_SAME,
    MAX_FREEFORM_BYTES,
    MAX_NDIM,
    ChunkRef,
    Manifest,
    TensorEntry,
    canonical_json,
    compute_digest,
)

HERE = Path(__file__).resolve().parent
BF16 = dtype_by_name("bfloat16")
COUNT = 4096  # elements of the chunk every chunk file is built around (bf16: 8 KiB raw)
MAX_FILE_BYTES = 100_000


def parent(seed: int, count: int = COUNT) -> np.ndarray:
    """The raw bytes of a 2-byte-element range before a chunk is applied (test_hostile.py copies this)."""
    return np.random.default_rng(seed).integers(0, 2**16, count, dtype=np.uint16).view(np.uint8).copy()


# ------------------------------------------------------------------------------- manifests


def _valid_manifest_doc() -> dict:
    """A valid delta manifest: one sparse chunk (tensors[0]) and one unchanged chunk (tensors[1])."""
    chunk = ChunkRef(
        start=0, stop=COUNT, codec="sparse", raw="a" * 32, object="b" * 32, key=chunk_key("b" * 32), size=200
    )
    tensors = (
        TensorEntry(name="model.layers.0.weight", dtype="bfloat16", shape=(64, 64), chunks=(chunk,)),
        TensorEntry(
            name="model.norm.weight",
            dtype="float32",
            shape=(64,),
            chunks=(ChunkRef(start=0, stop=64, codec="same", raw="c" * 32),),
        ),
    )
    manifest = Manifest(
        model="hostile",
        version=5,
        parent=4,
        base=1,
        kind="delta",
        step=5,
        created_unix_ms=1764000000000,
        tensors=tensors,
        digest=compute_digest(tensors),
        producer={"name": "weightsync"},
        stats={},
    )
    return manifest.to_json()


def _ref(c: dict) -> ChunkRef:
    return ChunkRef(**{**c, "box": Box(*c["box"])}) if "box" in c else ChunkRef(**c)


def _redigest(doc: dict) -> dict:
    """Recomputes the digest so a file reaches the check it targets, not the digest check."""
    tensors = [
        TensorEntry(
            name=t["name"], dtype=t["dtype"], shape=tuple(t["shape"]), chunks=tuple(_ref(c) for c in t["chunks"])
        )
        for t in doc["tensors"]
    ]
    doc["digest"] = compute_digest(tensors)
    return doc


def manifests() -> dict[str, tuple[bytes, str, str]]:
    """file name -> (bytes, error class name, message fragment)."""
    out: dict[str, tuple[bytes, str, str]] = {}
    valid = canonical_json(_valid_manifest_doc())

    def add(name, doc, error, match, redigest=True):
        if isinstance(doc, dict) and redigest:
            with contextlib.suppress(KeyError, TypeError, ValueError):  # too broken to digest: keeps its old one
                doc = _redigest(doc)
        data = doc if isinstance(doc, bytes) else canonical_json(doc)
        assert name not in out, name
        out[name] = (data, error, match)

    def mutate(fn):
        doc = _valid_manifest_doc()
        fn(doc)
        return doc

    def text(old: bytes, new: bytes) -> bytes:
        assert valid.count(old) == 1, old
        return valid.replace(old, new)

    def tensor0(**fields):
        return mutate(lambda d: d["tensors"][0].update(**fields))

    def chunk0(**fields):
        return mutate(lambda d: d["tensors"][0]["chunks"][0].update(**fields))

    # Ranges: contiguous from 0, no overlap, covering the tensor exactly, non-empty.
    add(
        "manifest_overlapping_ranges.json",
        mutate(
            lambda d: d["tensors"][0].update(
                chunks=[{**d["tensors"][0]["chunks"][0], "stop": 3000}, {**d["tensors"][0]["chunks"][0], "start": 2000}]
            )
        ),
        "FormatError",
        "chunk starts at 2000, expected 3000",
    )
    add(
        "manifest_gap_between_ranges.json",
        mutate(
            lambda d: d["tensors"][0].update(
                chunks=[{**d["tensors"][0]["chunks"][0], "stop": 2000}, {**d["tensors"][0]["chunks"][0], "start": 2001}]
            )
        ),
        "FormatError",
        "chunk starts at 2001, expected 2000",
    )
    add("manifest_missing_range.json", chunk0(stop=4000), "FormatError", "chunks cover 4000 of its 4096")
    add("manifest_no_chunks.json", tensor0(chunks=[]), "FormatError", "chunks cover 0 of its 4096")
    add("manifest_range_beyond_tensor.json", chunk0(stop=5000), "FormatError", "[0, 5000) beyond its 4096 elements")
    add(
        "manifest_empty_range.json",
        mutate(
            lambda d: d["tensors"][0].update(
                chunks=[{**d["tensors"][0]["chunks"][0], "stop": 0}, d["tensors"][0]["chunks"][0]]
            )
        ),
        "FormatError",
        "stop must be an integer in [1,",
    )
    add(
        "manifest_chunk_too_big.json",
        mutate(lambda d: d["tensors"][0].update(shape=[2**26]) or d["tensors"][0]["chunks"][0].update(stop=2**26)),
        "FormatError",
        "over the 67108864 limit",
    )

    # Paths: names and keys never escape their prefix.
    add("manifest_traversal_name.json", tensor0(name="../etc/passwd"), "FormatError", "'..' path segment")
    add("manifest_traversal_name_absolute.json", tensor0(name="/abs"), "FormatError", "is absolute")
    add("manifest_traversal_name_inner.json", tensor0(name="a/../b"), "FormatError", "'..' path segment")
    add("manifest_traversal_name_dot.json", tensor0(name="a/./b"), "FormatError", "'.' or '..' path segment")
    add("manifest_traversal_name_backslash.json", tensor0(name="a\\..\\..\\b"), "FormatError", "backslashes")
    add("manifest_name_control_char.json", tensor0(name="a\x00b"), "FormatError", "control characters")
    add("manifest_name_empty.json", tensor0(name=""), "FormatError", "non-empty string")
    add("manifest_name_too_long.json", tensor0(name="x" * 1025), "FormatError", "at most 1024 characters")
    add("manifest_traversal_key.json", chunk0(key="../../../x"), "FormatError", "is not the content address")
    add(
        "manifest_traversal_key_absolute.json",
        chunk0(key="/" + chunk_key("b" * 32)),
        "FormatError",
        "is not the content address",
    )
    add(
        "manifest_traversal_key_inner.json",
        chunk0(key="chunks/bb/../../../../etc/passwd"),
        "FormatError",
        "is not the content address",
    )
    add(
        "manifest_key_not_matching_object.json",
        chunk0(key=chunk_key("d" * 32)),
        "FormatError",
        "is not the content address",
    )
    add("manifest_bad_model_name.json", mutate(lambda d: d.update(model="../x")), "FormatError", "invalid model name")

    # Versions of the format, codecs, dtypes.
    add(
        "manifest_unknown_format.json",
        mutate(lambda d: d.update(format=99)),
        "UnsupportedFormatError",
        "manifest format 99 is not supported by this build; supported: [1, 2, 3]",
    )
    add(
        "manifest_missing_format.json",
        mutate(lambda d: d.pop("format")),
        "UnsupportedFormatError",
        "supported: [1, 2, 3]",
    )
    add(
        "manifest_format_string.json",
        mutate(lambda d: d.update(format="1")),
        "UnsupportedFormatError",
        "supported: [1, 2, 3]",
    )
    add(
        "manifest_format_bool.json",
        text(b'"format":1', b'"format":true'),
        "UnsupportedFormatError",
        "supported: [1, 2, 3]",
    )

    # Packs (format 2): the manifest is the pack's index.
    def packed(doc, chunks):
        doc["format"] = 2
        doc["tensors"][0]["chunks"] = chunks
        return doc

    def member(start, stop, offset, key=None, size=200):
        return {
            "start": start,
            "stop": stop,
            "codec": "sparse",
            "raw": "a" * 32,
            "object": "b" * 32,
            "key": key or pack_key("d" * 32),
            "size": size,
            "offset": offset,
        }

    add(
        "manifest_packed_chunk_in_format_1.json",
        chunk0(key=pack_key("d" * 32), offset=0),
        "FormatError",
        "packed chunks ('offset') need manifest format 2",
    )
    add(
        "manifest_pack_traversal_key.json",
        mutate(lambda d: packed(d, [member(0, COUNT, 0, key="packs/../../x")])),
        "FormatError",
        "is not a pack's content address",
    )
    add(
        "manifest_pack_chunk_key_as_pack.json",
        mutate(lambda d: packed(d, [member(0, COUNT, 0, key=chunk_key("b" * 32))])),
        "FormatError",
        "is not a pack's content address",
    )
    add(
        "manifest_pack_negative_offset.json",
        mutate(lambda d: packed(d, [member(0, COUNT, -1)])),
        "FormatError",
        "offset must be an integer in [0,",
    )
    add(
        "manifest_pack_offset_past_limit.json",
        mutate(lambda d: packed(d, [member(0, COUNT, 1 << 32)])),
        "FormatError",
        "offset must be an integer in [0,",
    )
    add(
        "manifest_pack_overlapping_members.json",
        mutate(lambda d: packed(d, [member(0, 2048, 0), dict(member(2048, COUNT, 150), object="e" * 32)])),
        "FormatError",
        "overlap (a bad pack index)",
    )

    # Boxes (format 3): each chunk a box of its tensor (64 x 64), all boxes covering it exactly once.
    def boxes(doc, regions, fmt=3, shape=None):
        doc["format"] = fmt
        tensor = doc["tensors"][0]
        if shape is not None:
            tensor["shape"] = shape
        template = {k: v for k, v in tensor["chunks"][0].items() if k not in ("start", "stop")}
        tensor["chunks"] = [{**template, "box": region} for region in regions]
        return doc

    halves = [[[0, 0], [64, 32]], [[0, 32], [64, 32]]]  # a row-parallel weight's two column shards

    def mixed(doc):  # the second half as a flat range, which it is not: the forms must not mix
        chunks = doc["tensors"][0]["chunks"]
        flat = {k: v for k, v in chunks[0].items() if k != "box"}
        chunks.append({**flat, "start": 2048, "stop": 4096})

    add(
        "manifest_box_chunk_in_format_2.json",
        mutate(lambda d: boxes(d, halves, fmt=2)),
        "FormatError",
        "box chunks ('box') need manifest format 3, this one is 2",
    )
    add(
        "manifest_box_overlap.json",
        mutate(lambda d: boxes(d, [[[0, 0], [64, 33]], [[0, 32], [64, 32]]])),
        "FormatError",
        "box(offsets=[0, 32], sizes=[64, 32]) overlaps box(offsets=[0, 0], sizes=[64, 33])",
    )
    add(
        "manifest_box_hole.json",
        mutate(lambda d: boxes(d, [[[0, 0], [64, 32]], [[0, 32], [63, 32]]])),
        "FormatError",
        "box(offsets=[63, 32], sizes=[1, 32]) is covered by no chunk (a hole)",
    )
    add(
        "manifest_box_outside_tensor.json",
        mutate(lambda d: boxes(d, [[[0, 0], [64, 32]], [[0, 32], [64, 33]]])),
        "FormatError",
        "does not lie inside the tensor's shape [64, 64]",
    )
    add(
        "manifest_box_wrong_dims.json",
        mutate(lambda d: boxes(d, [[[0], [4096]]])),
        "FormatError",
        "does not lie inside the tensor's shape [64, 64]",
    )
    add(
        "manifest_box_empty.json",
        mutate(lambda d: boxes(d, [[[0, 0], [0, 64]], *halves])),
        "FormatError",
        "is empty",
    )
    add(
        "manifest_box_negative.json",
        mutate(lambda d: boxes(d, [[[-1, 0], [64, 32]], [[0, 32], [64, 32]]])),
        "FormatError",
        "non-negative",
    )
    add(
        "manifest_box_not_two_lists.json",
        mutate(lambda d: boxes(d, [[0, 0, 64, 64]])),
        "FormatError",
        "a box is [offsets, sizes]",
    )
    add(
        "manifest_box_float.json",
        text(b'"format":1', b'"format":3').replace(b'"start":0,"stop":4096', b'"box":[[0,0],[64,64.0]]', 1),
        "FormatError",
        "numbers must be integers",
        redigest=False,
    )
    add(
        "manifest_box_out_of_order.json",
        mutate(lambda d: boxes(d, halves[::-1])),
        "FormatError",
        "strictly increasing order of their offsets",
    )
    add(
        "manifest_box_mixed_with_range.json",
        mutate(lambda d: mixed(boxes(d, [halves[0]]))),
        "FormatError",
        "chunks must be all flat ranges or all boxes, not both",
    )
    add(
        "manifest_box_over_chunk_limit.json",
        mutate(lambda d: boxes(d, [[[0, 0], [1 << 20, 1 << 20]]], shape=[1 << 20, 1 << 20])),
        "FormatError",
        "over the 67108864-byte chunk limit",
    )
    add(
        "manifest_box_grid_over_limit.json",
        mutate(lambda d: boxes(d, [[[i, i, i], [1, 1, 1]] for i in range(257)], shape=[257, 257, 257])),
        "FormatError",
        "cut it into 16974593 cells, over the limit of 16777216",
    )
    add(
        "manifest_unknown_codec.json",
        chunk0(codec="lz4"),
        "UnsupportedFormatError",
        f"unknown codec 'lz4'; supported: {sorted([*CODEC_IDS, CODEC_SAME])}",  # the registry's names
    )
    add("manifest_codec_not_string.json", chunk0(codec=3), "FormatError", "codec must be a string")
    add(
        "manifest_unknown_dtype.json",
        tensor0(dtype="complex64"),
        "UnsupportedFormatError",
        "unsupported dtype 'complex64'",
    )
    add("manifest_unknown_field.json", mutate(lambda d: d.update(extra=1)), "FormatError", "unknown fields ['extra']")
    add("manifest_missing_field.json", mutate(lambda d: d.pop("step")), "FormatError", "missing fields ['step']")
    add(
        "manifest_same_chunk_with_object.json",
        mutate(lambda d: d["tensors"][1]["chunks"][0].update(object="b" * 32, key=chunk_key("b" * 32), size=100)),
        "FormatError",
        "unknown fields ['key', 'object', 'size']",
    )

    # JSON itself: integers only, unique keys, canonical bytes, bounded nesting.
    add(
        "manifest_float_number.json",
        text(b'"step":5', b'"step":5.0'),
        "FormatError",
        "manifest numbers must be integers, got 5.0",
    )
    add(
        "manifest_exponent_number.json",
        text(b'"step":5', b'"step":5e0'),
        "FormatError",
        "manifest numbers must be integers",
    )
    add(
        "manifest_nan_constant.json",
        text(b'"step":5', b'"step":NaN'),
        "FormatError",
        "manifest numbers must be integers, got NaN",
    )
    add(
        "manifest_infinity_constant.json",
        text(b'"step":5', b'"step":-Infinity'),
        "FormatError",
        "manifest numbers must be integers, got -Infinity",
    )
    add(
        "manifest_huge_integer.json",
        text(b'"step":5', b'"step":' + b"9" * 5000),
        "FormatError",
        "manifest is not valid JSON",
    )
    add(
        "manifest_duplicate_key.json",
        text(b'"step":5', b'"step":5,"step":6'),
        "FormatError",
        "manifest has duplicate keys",
    )
    add(
        "manifest_duplicate_key_nested.json",
        text(b'"start":0,"stop":4096', b'"start":0,"start":0,"stop":4096'),
        "FormatError",
        "manifest has duplicate keys",
    )
    add(
        "manifest_not_canonical.json",
        json.dumps(_valid_manifest_doc(), indent=1).encode(),
        "FormatError",
        "not in canonical form",
    )
    add(
        "manifest_unsorted_keys.json",
        json.dumps(_valid_manifest_doc(), separators=(",", ":")).encode(),
        "FormatError",
        "not in canonical form",
    )
    add("manifest_utf8_bom.json", b"\xef\xbb\xbf" + valid, "FormatError", "not in canonical form")
    add("manifest_utf16.json", valid.decode().encode("utf-16"), "FormatError", "not in canonical form")
    add("manifest_not_json.json", b"\x00\xffnot json", "FormatError", "manifest is not valid JSON")
    add("manifest_empty.json", b"", "FormatError", "manifest is not valid JSON")
    add("manifest_truncated.json", valid[: len(valid) // 2], "FormatError", "manifest is not valid JSON")
    add("manifest_trailing_data.json", valid + b"{}", "FormatError", "manifest is not valid JSON")
    add("manifest_array.json", b"[1,2,3]", "FormatError", "manifest must be a JSON object")
    add(
        "manifest_deep_nesting.json",
        b'{"format":1,"producer":' + b"[" * 40_000 + b"]" * 40_000 + b"}",
        "FormatError",
        "manifest is not valid JSON",
    )
    add(
        "manifest_deep_nesting_objects.json",
        b'{"format":1,"producer":' + b'{"a":' * 15_000 + b"1" + b"}" * 15_000 + b"}",
        "FormatError",
        "manifest is not valid JSON",
    )
    add(
        "manifest_producer_too_big.json",
        mutate(lambda d: d.update(producer={"x": "y" * MAX_FREEFORM_BYTES})),
        "FormatError",
        "producer must be a JSON object of at most 65536 bytes",
    )
    add(
        "manifest_producer_not_object.json",
        mutate(lambda d: d.update(producer=[1])),
        "FormatError",
        "producer must be a JSON object",
    )
    add(
        "manifest_stats_not_int.json",
        mutate(lambda d: d.update(stats={"x": "1"})),
        "FormatError",
        "stats values must be integers",
    )

    # Digest and numbers.
    add(
        "manifest_bad_digest.json",
        mutate(lambda d: d.update(digest="e" * 32)),
        "IntegrityError",
        "does not match its own digest",
        redigest=False,
    )
    add(
        "manifest_digest_not_hex.json",
        mutate(lambda d: d.update(digest="E" * 32)),
        "FormatError",
        "digest must be 32 lowercase hex",
        redigest=False,
    )
    add("manifest_raw_not_hex.json", chunk0(raw="z" * 32), "FormatError", "raw hash must be 32 lowercase hex")
    add(
        "manifest_huge_shape.json",
        tensor0(shape=[2**40, 2**40]),
        "FormatError",
        "shape [1099511627776, 1099511627776] exceeds 70368744177664 bytes",
    )
    add(
        "manifest_huge_shape_many_dims.json",
        tensor0(shape=[2**20] * MAX_NDIM),
        "FormatError",
        "exceeds 70368744177664 bytes",
    )
    add("manifest_huge_dim.json", tensor0(shape=[2**47]), "FormatError", "shape must be an integer in [0,")
    add(
        "manifest_too_many_dims.json",
        tensor0(shape=[1] * (MAX_NDIM + 1)),
        "FormatError",
        "shape must be a list of at most 64 sizes",
    )
    add("manifest_negative_size.json", tensor0(shape=[-64, -64]), "FormatError", "got -64")
    add("manifest_bool_dim.json", text(b'"shape":[64,64]', b'"shape":[true,64]'), "FormatError", "got True")
    add("manifest_oversized_object.json", chunk0(size=2**40), "FormatError", "size must be an integer in [65, 12864]")
    add(
        "manifest_bool_version.json",
        text(b'"version":5', b'"version":true'),
        "FormatError",
        "version must be an integer in [1, 999999999999], got True",
    )
    add(
        "manifest_version_zero.json",
        mutate(lambda d: d.update(version=0)),
        "FormatError",
        "version must be an integer in [1,",
    )
    add("manifest_negative_step.json", mutate(lambda d: d.update(step=-1)), "FormatError", "step must be an integer")

    # Version chains.
    add(
        "manifest_delta_without_parent.json",
        mutate(lambda d: d.update(parent=None)),
        "FormatError",
        "a delta needs base <= parent < version, got base 1, parent None",
    )
    add(
        "manifest_parent_in_future.json",
        mutate(lambda d: d.update(parent=9)),
        "FormatError",
        "parent must be an integer in [1, 4], got 9",
    )
    add(
        "manifest_parent_before_base.json",
        mutate(lambda d: d.update(base=4, parent=3)),
        "FormatError",
        "a delta needs base <= parent < version",
    )
    add(
        "manifest_full_not_own_base.json",
        mutate(lambda d: d.update(kind="full", base=1, parent=None)),
        "FormatError",
        "a full version is its own base",
    )
    add(
        "manifest_unknown_kind.json",
        mutate(lambda d: d.update(kind="patch")),
        "FormatError",
        "kind must be 'full' or 'delta'",
    )
    add(
        "manifest_full_with_same_chunk.json",
        mutate(
            lambda d: d.update(kind="full", base=5, parent=None) or d["tensors"][0]["chunks"][0].update(codec="full")
        ),
        "FormatError",
        "a full version cannot have unchanged ('same') chunks",
    )
    add(
        "manifest_full_with_delta_chunk.json",
        mutate(lambda d: d.update(kind="full", base=5, parent=None)),
        "FormatError",
        "a full version can only hold 'full' chunks, got 'sparse'",
    )

    # Tensors.
    add(
        "manifest_unsorted_tensors.json",
        mutate(lambda d: d["tensors"].reverse()),
        "FormatError",
        "tensor names must be unique and sorted",
    )
    add(
        "manifest_duplicate_tensor.json",
        mutate(lambda d: d["tensors"].insert(0, d["tensors"][0])),
        "FormatError",
        "tensor names must be unique and sorted",
    )
    add(
        "manifest_tensors_not_list.json",
        mutate(lambda d: d.update(tensors={"a": 1})),
        "FormatError",
        "tensors must be a list",
    )
    add(
        "manifest_tensor_not_object.json",
        mutate(lambda d: d.update(tensors=[1])),
        "FormatError",
        "each tensor must be a JSON object",
    )
    return out


# ---------------------------------------------------------------------------------- chunks


def _frame_claiming(size: int) -> bytes:
    """A zstd frame header (single segment, 8-byte content size) claiming `size` bytes, then one
    tiny raw block: a frame an attacker writes by hand, nothing a compressor would produce."""
    magic = struct.pack("<I", 0xFD2FB528)
    descriptor = bytes([0b1110_0000])  # FCS field 8 bytes, single segment, no checksum, no dict
    block = struct.pack("<I", (4 << 3) | 1)[:3] + b"abcd"  # last block, raw, 4 bytes
    return magic + descriptor + struct.pack("<Q", size) + block


def chunks() -> dict[str, tuple[bytes, dict]]:
    """file name -> (object bytes, how to apply it and what it must raise)."""
    old = parent(0)
    new = old.copy()
    new.view(np.uint16)[::50] ^= 1  # 82 changed elements: a sparse delta (with ctx off), a ctx delta
    codec_id, raw_hex, good, changed = encode_chunk(new, old, BF16, 1, choice=CodecChoice(highest_codec=CODEC_SPARSE))
    assert (codec_id, changed) == (CODEC_SPARSE, 82)
    ctx_id, _, good_ctx, _ = encode_chunk(new, old, BF16, 1)
    assert ctx_id == CODEC_CTX
    rans_id, _, good_rans, _ = encode_chunk(new, old, BF16, 1, choice=CodecChoice(rans_from_changes=1))
    assert rans_id == CODEC_RANS
    full_id, _, full, _ = encode_chunk(new, None, BF16, 1)
    assert full_id == CODEC_FULL
    other_raw = xxh3_digest(old)  # the hash of bytes a chunk does not decode to
    base = {
        "dtype": "bfloat16",
        "count": COUNT,
        "raw": raw_hex,
        "codec": codec_id,
        "parent_seed": 0,
        "stage": "apply",
        "touches": False,
    }
    out: dict[str, tuple[bytes, dict]] = {}

    def add(name, data, error, match, **overrides):
        assert name not in out, name
        out[name] = (data, {**base, "error": error, "match": match, **overrides})

    names = ["magic", "fmt", "codec", "level", "dtype", "flags", "hsize", "reserved", "count", "plen", "raw", "phash"]

    def header(obj=good, payload=None, reserved=b"\0\0\0\0", **fields):
        """`obj` with some header fields replaced; a new payload gets a correct length and hash."""
        values = dict(zip(names, HEADER.unpack_from(obj, 0), strict=True))
        body = obj[64:]
        if payload is not None:
            body = payload
            values.update(plen=len(payload), phash=xxh3_digest(payload))
        values.update(fields)
        packed = bytearray(HEADER.pack(*[values[n] for n in names]))
        packed[12:16] = reserved
        return bytes(packed) + body

    def streams(*frames_and_lens):
        table = b"".join(struct.pack("<QQ", raw_len, len(frame)) for frame, raw_len in frames_and_lens)
        return bytes([len(frames_and_lens)]) + table + b"".join(f for f, _ in frames_and_lens)

    # Framing: length, magic, versions, fields. unpack_chunk refuses all of these.
    add(
        "chunk_empty.bin",
        b"",
        "FormatError",
        "chunk object of 0 bytes is shorter than its 64-byte header",
        stage="unpack",
    )
    add("chunk_truncated_header.bin", good[:40], "FormatError", "shorter than its 64-byte header", stage="unpack")
    add("chunk_truncated.bin", good[:-5], "FormatError", "but its header declares", stage="unpack")
    add("chunk_oversized.bin", good + b"\0" * 100, "FormatError", "but its header declares", stage="unpack")
    add("chunk_bad_magic.bin", b"NOPE" + good[4:], "FormatError", "not a weightsync chunk", stage="unpack")
    add(
        "chunk_unknown_version.bin",
        header(fmt=7),
        "UnsupportedFormatError",
        "chunk format version 7 is not supported; supported: [1]",
        stage="unpack",
    )
    add(
        "chunk_unknown_codec.bin",
        header(codec=9),
        "UnsupportedFormatError",
        f"unknown codec id 9; supported: {sorted(CODEC_NAMES)}",  # the registry's ids
        stage="unpack",
    )
    add(
        "chunk_unknown_dtype.bin", header(dtype=200), "UnsupportedFormatError", "unknown dtype code 200", stage="unpack"
    )
    add("chunk_nonzero_flags.bin", header(flags=1), "FormatError", "flags 1 not valid", stage="unpack")
    add("chunk_nonzero_reserved.bin", header(reserved=b"\xde\xad\xbe\xef"), "FormatError", "reserved", stage="unpack")
    add("chunk_header_size.bin", header(hsize=128), "FormatError", "chunk header size 128", stage="unpack")
    add("chunk_level_out_of_range.bin", header(level=23), "FormatError", "zstd level 23 out of range", stage="unpack")
    add(
        "chunk_too_many_elements.bin",
        header(count=2**40),
        "FormatError",
        "exceeds the 67108864-byte limit",
        stage="unpack",
    )
    add(
        "chunk_payload_hash_mismatch.bin",
        good[:-1] + bytes([good[-1] ^ 1]),
        "IntegrityError",
        "chunk payload does not match the hash in its header",
        stage="unpack",
    )

    # The header against the manifest.
    add("chunk_manifest_raw_mismatch.bin", good, "IntegrityError", "raw hash differs from the manifest's", raw="0" * 32)
    add(
        "chunk_wrong_dtype.bin",
        good,
        "FormatError",
        "chunk dtype bfloat16 does not match tensor dtype float16",
        dtype="float16",
    )
    add("chunk_wrong_count.bin", good, "FormatError", "chunk holds 4096 elements, its range 4095", count=COUNT - 1)
    add(
        "chunk_codec_mismatch.bin",
        good,
        "FormatError",
        "chunk codec sparse differs from the manifest's xor",
        codec=CODEC_XOR,
    )

    # Decodes cleanly to other bytes than its raw hash says: only the final check catches it.
    add(
        "chunk_raw_hash_mismatch.bin",
        header(full, raw=other_raw),
        "IntegrityError",
        "chunk decoded to bytes whose hash differs from the published one",
        codec=CODEC_FULL,
        raw=other_raw.hex(),
        touches=True,
    )
    add(
        "chunk_applied_to_wrong_parent.bin",
        good,
        "IntegrityError",
        "decoded to bytes whose hash differs",
        parent_seed=1,
        touches=True,
    )

    # Payloads with valid framing (length and hash right) whose streams are off-spec.
    c = zstandard.ZstdCompressor(level=1)
    n = 82  # changed elements the sparse payloads declare
    gaps = c.compress(bytes([49] * n))
    lo, hi = c.compress(bytes([1] * n)), c.compress(bytes(n))
    plane = c.compress(bytes(COUNT))
    add("chunk_empty_payload.bin", header(payload=b""), "FormatError", "sparse payload truncated")
    add(
        "chunk_empty_payload_full.bin",
        header(full, payload=b""),
        "FormatError",
        "codec payload is empty",
        codec=CODEC_FULL,
    )
    add(
        "chunk_stream_table_truncated.bin",
        header(full, payload=streams((plane, COUNT), (plane, COUNT))[:20]),
        "FormatError",
        "truncated in its stream table",
        codec=CODEC_FULL,
    )
    add(
        "chunk_stream_truncated.bin",
        header(full, payload=streams((plane, COUNT), (plane, COUNT))[:-3]),
        "FormatError",
        "stream 1 truncated",
        codec=CODEC_FULL,
    )
    add(
        "chunk_stream_count.bin",
        header(payload=streams((gaps, n), (lo, n), (hi, n))),
        "FormatError",
        "codec payload has 3 streams, expected 4",
    )
    add(
        "chunk_full_codec_short_plane.bin",
        header(codec=CODEC_FULL, payload=streams((lo, n), (hi, n))),
        "FormatError",
        "stream 0 declares 82 bytes, expected 4096",
        codec=CODEC_FULL,
    )
    add(
        "chunk_empty_stream_with_bytes.bin",
        header(payload=streams((gaps, n), (b"\0" * 5, 0), (lo, n), (hi, n))),
        "FormatError",
        "stream 1 is empty but carries 5 compressed bytes",
    )
    add(
        "chunk_not_zstd.bin",
        header(payload=streams((b"garbage!" * 4, n), (b"", 0), (lo, n), (hi, n))),
        "FormatError",
        "stream 0: not a zstd frame",
    )
    add(
        "chunk_corrupt_zstd.bin",
        header(payload=streams((gaps[:-2] + b"\xff\xff", n), (b"", 0), (lo, n), (hi, n))),
        "FormatError",
        "stream 0: corrupt zstd frame",
    )
    add(
        "chunk_frame_trailing_data.bin",
        header(payload=streams((gaps + b"\0\0\0", n), (b"", 0), (lo, n), (hi, n))),
        "FormatError",
        "stream 0: corrupt zstd frame",
    )
    add(
        "chunk_trailing_garbage.bin",
        header(payload=streams((gaps, n), (b"", 0), (lo, n), (hi, n)) + b"junk"),
        "FormatError",
        "codec payload has 4 trailing bytes",
    )

    # zstd bombs: refused before anything near the claimed size is allocated.
    real_claims = c.compress(bytes(1 << 20))  # a real frame whose header says 1 MiB; the table says 82
    add(
        "chunk_zstd_bomb_claims.bin",
        header(payload=streams((gaps, n), (b"", 0), (real_claims, n), (hi, n))),
        "FormatError",
        "stream 2: zstd frame claims 1048576 bytes, expected 82",
    )
    add(
        "chunk_zstd_bomb_claims_1tib.bin",
        header(full, payload=streams((_frame_claiming(1 << 40), COUNT), (plane, COUNT))),
        "FormatError",
        "stream 0: zstd frame claims 1099511627776 bytes, expected 4096",
        codec=CODEC_FULL,
    )
    no_size = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(bytes(64 << 20))
    add(
        "chunk_zstd_bomb_expands.bin",
        header(payload=streams((gaps, n), (b"", 0), (no_size, n), (hi, n))),
        "FormatError",
        "stream 2: corrupt zstd frame",
    )
    add(
        "chunk_zstd_bomb_expands_full.bin",
        header(full, payload=streams((no_size, COUNT), (plane, COUNT))),
        "FormatError",
        "stream 0: corrupt zstd frame",
        codec=CODEC_FULL,
    )
    huge = zstandard.ZstdCompressor(level=19).compress(bytes(1 << 20))
    add(
        "chunk_sparse_overflow_claims_huge.bin",
        header(payload=streams((gaps, n), (huge, 1 << 40), (lo, n), (hi, n))),
        "FormatError",
        "stream 1 declares 1099511627776 bytes",
    )

    # sparse: positions and counts.
    far = c.compress(bytes([255] * n))  # 82 escaped gaps ...
    add(
        "chunk_sparse_position_out_of_range.bin",  # ... each 255 + 0xff, far past element 4095
        header(payload=streams((far, n), (c.compress(b"\xff" * n + b"\0" * 3 * n), 4 * n), (lo, n), (hi, n))),
        "FormatError",
        "is outside the chunk of 4096 elements",
    )
    add(
        "chunk_sparse_position_just_past_end.bin",
        header(payload=_sparse_payload(c, [COUNT], 2)),
        "FormatError",
        "sparse position 4096 is outside the chunk of 4096 elements",
    )
    add(
        "chunk_sparse_last_position_ok_then_past_end.bin",
        header(payload=_sparse_payload(c, [0, 300, COUNT + 7], 2)),
        "FormatError",
        "sparse position 4103 is outside the chunk",
    )
    add(
        "chunk_sparse_overflow_length.bin",
        header(payload=streams((far, n), (b"", 0), (lo, n), (hi, n))),
        "FormatError",
        "sparse overflow stream has 0 bytes, expected 328",
    )
    add(
        "chunk_sparse_too_many_changes.bin",
        header(payload=streams((gaps, COUNT + 1), (b"", 0), (lo, n), (hi, n))),
        "FormatError",
        "sparse payload claims 4097 changed elements in a chunk of 4096",
    )

    # ctx (docs/format.md, "Codec ctx"): u64 changed, u16 class base, then the range coder's bytes.
    ctx = {"codec": CODEC_CTX}
    body = good_ctx[64:]
    changed_ctx, class_base = struct.unpack_from("<QH", body, 0)
    stream = body[10:]

    def ctx_payload(changed=changed_ctx, base=class_base, rc=stream):
        return struct.pack("<QH", changed, base) + rc

    add(
        "chunk_ctx_truncated_header.bin",
        header(good_ctx, payload=body[:7]),
        "FormatError",
        "ctx payload of 7 bytes is shorter than its 10-byte header",
        **ctx,
    )
    add(
        "chunk_ctx_too_many_changes.bin",
        header(good_ctx, payload=ctx_payload(changed=COUNT + 1)),
        "FormatError",
        "ctx payload claims 4097 changed elements in a chunk of 4096",
        **ctx,
    )
    add(
        "chunk_ctx_claims_2_64_changes.bin",
        header(good_ctx, payload=ctx_payload(changed=2**64 - 1)),
        "FormatError",
        "ctx payload claims 18446744073709551615 changed elements",
        **ctx,
    )
    add(
        "chunk_ctx_class_base_out_of_range.bin",
        header(good_ctx, payload=ctx_payload(base=256)),
        "FormatError",
        "ctx class base 256 is out of range for bfloat16",
        **ctx,
    )
    add(
        "chunk_ctx_empty_stream.bin",
        header(good_ctx, payload=ctx_payload(rc=b"")),
        "FormatError",
        "range coder stream truncated",
        **ctx,
    )
    add(
        "chunk_ctx_stream_not_starting_with_zero.bin",
        header(good_ctx, payload=ctx_payload(rc=b"\x01" + stream[1:])),
        "FormatError",
        "range coder stream does not start with a zero byte",
        **ctx,
    )
    add(
        "chunk_ctx_stream_truncated.bin",
        header(good_ctx, payload=ctx_payload(rc=stream[: len(stream) // 2])),
        "FormatError",
        "ctx payload is corrupt",
        **ctx,
    )  # past its end the coder reads zeros: nonsense, caught
    add(
        "chunk_ctx_stream_trailing_bytes.bin",
        header(good_ctx, payload=ctx_payload(rc=stream + b"\0\0")),
        "FormatError",
        "range coder stream has trailing bytes",
        **ctx,
    )
    add(
        "chunk_ctx_declares_fewer_changes.bin",
        header(good_ctx, payload=ctx_payload(changed=changed_ctx - 1)),
        "FormatError",
        "more changed elements than the header declares",
        **ctx,
    )
    add(
        "chunk_ctx_declares_more_changes.bin",
        header(good_ctx, payload=ctx_payload(changed=changed_ctx + 1)),
        "FormatError",
        "fewer changed elements than the header declares",
        **ctx,
    )
    rng = np.random.default_rng(13)
    for k in range(4):  # random streams: whatever they decode to, the decoder stops with a FormatError
        noise = b"\0" + rng.integers(0, 256, 64 << k, dtype=np.uint8).tobytes()
        add(
            f"chunk_ctx_random_stream_{k}.bin",
            header(good_ctx, payload=ctx_payload(rc=noise)),
            "FormatError",
            "ctx payload is corrupt",
            **ctx,
        )
    flipped = bytearray(stream)
    flipped[len(stream) // 3] ^= 0x10
    add(
        "chunk_ctx_stream_bit_flip.bin",
        header(good_ctx, payload=ctx_payload(rc=bytes(flipped))),
        "FormatError",
        "ctx payload is corrupt",
        **ctx,
    )
    add(
        "chunk_ctx_applied_to_wrong_parent.bin", good_ctx, "FormatError", "ctx payload is corrupt", parent_seed=1, **ctx
    )

    # rans (docs/format.md, "Codec rans"): u64 changed, u16 class base, u16 class mask, u32 rANS
    # words; the class tables, the rANS words, the raw bit words.
    rans = {"codec": CODEC_RANS}
    body = good_rans[64:]
    changed_rans, base_rans, mask_rans, nwords = struct.unpack_from("<QHHI", body, 0)
    table_bytes = rans_codec._read_tables(
        np.frombuffer(body[16:], np.uint8),
        mask_rans,
        16,
        np.zeros(16, np.int64),
        np.zeros(2 * 16 * 2048, np.uint32),
        np.zeros(390, np.int64),
    )[1]
    tables, rest = body[16 : 16 + table_bytes], body[16 + table_bytes :]
    words, raw_bits = rest[: 2 * nwords], rest[2 * nwords :]

    def rans_payload(changed=changed_rans, base=base_rans, mask=mask_rans, n=nwords, t=tables, w=words, r=raw_bits):
        return struct.pack("<QHHI", changed, base, mask, n) + t + w + r

    def add_rans(name, payload, match):
        add(f"chunk_rans_{name}.bin", header(good_rans, payload=payload), "FormatError", match, **rans)

    add_rans("truncated_header", body[:10], "rans payload of 10 bytes is shorter than its 16-byte header")
    add_rans(
        "too_many_changes",
        rans_payload(changed=COUNT + 1),
        "rans payload claims 4097 changed elements in a chunk of 4096",
    )
    add_rans("class_base_out_of_range", rans_payload(base=256), "rans class base 256 is out of range for bfloat16")
    add_rans("tables_truncated", rans_payload(t=tables[:3], w=b"", r=b""), "class table section runs past the payload")
    add_rans(
        "declares_more_changes",
        rans_payload(changed=changed_rans + 1),
        "per-class change counts do not add up to the header's",
    )
    unused_class = next(c for c in range(16) if not mask_rans >> c & 1)
    add_rans("extra_class_in_mask", rans_payload(mask=mask_rans | 1 << unused_class), "rans payload is corrupt")
    add_rans(
        "declares_too_many_words",
        rans_payload(n=nwords + len(raw_bits)),
        f"rans payload declares {nwords + len(raw_bits)} rANS words",
    )
    add_rans("raw_bits_not_whole_words", rans_payload(r=raw_bits + b"\0\0\0"), "rans raw bit stream of")
    add_rans("raw_bits_extra_word", rans_payload(r=raw_bits + bytes(8)), "raw bit stream has extra words")
    add_rans("initial_state_zero", rans_payload(w=bytes(4) + words[4:]), "rANS initial state out of range")
    add_rans(
        "words_left_over",
        rans_payload(n=nwords + 4, w=words + bytes([1, 0, 0, 1, 0, 0, 1, 0])),
        "rANS stream has words left over",
    )
    flipped = bytearray(words)
    flipped[len(words) // 2] ^= 0x10
    add_rans("stream_bit_flip", rans_payload(w=bytes(flipped)), "rans payload is corrupt")
    for k in range(4):  # random words and raw bits: whatever they decode to, the decoder stops with a FormatError
        noise = rng.integers(0, 256, 2 * nwords + len(raw_bits), dtype=np.uint8).tobytes()
        add_rans(
            f"random_stream_{k}", rans_payload(w=noise[: 2 * nwords], r=noise[2 * nwords :]), "rans payload is corrupt"
        )
    add(
        "chunk_rans_applied_to_wrong_parent.bin",
        good_rans,
        "FormatError",
        "rans payload is corrupt",
        parent_seed=1,
        **rans,
    )
    return out


def _sparse_payload(compressor: zstandard.ZstdCompressor, positions: list[int], itemsize: int) -> bytes:
    """A sparse payload that flips the low bit at `positions`, whatever they are (even out of range)."""
    gaps = np.diff(np.array(positions, dtype=np.int64), prepend=-1) - 1
    gap_bytes = np.minimum(gaps, 255).astype(np.uint8).tobytes()
    over = (gaps[gaps >= 255] - 255).astype("<u4")
    overflow = b"".join(bytes(over.view(np.uint8).reshape(-1, 4)[:, k]) for k in range(4))
    m = len(positions)
    planes = [bytes([1] * m)] + [bytes(m)] * (itemsize - 1)
    frames = [(compressor.compress(s) if s else b"", len(s)) for s in [gap_bytes, overflow, *planes]]
    table = b"".join(struct.pack("<QQ", raw_len, len(f)) for f, raw_len in frames)
    return bytes([len(frames)]) + table + b"".join(f for f, _ in frames)


def main() -> None:
    expected = {}
    for name, (data, error, match) in manifests().items():
        expected[name] = {"kind": "manifest", "error": error, "match": match}
        (HERE / name).write_bytes(data)
    for name, (data, spec) in chunks().items():
        expected[name] = {"kind": "chunk", **spec}
        (HERE / name).write_bytes(data)
    for name in expected:
        assert (HERE / name).stat().st_size < MAX_FILE_BYTES, name
    stale = {p.name for p in HERE.iterdir() if p.suffix in (".json", ".bin")} - set(expected) - {"expected.json"}
    for name in sorted(stale):
        (HERE / name).unlink()
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(expected)} hostile inputs to {HERE}" + (f", removed {sorted(stale)}" if stale else ""))


if __name__ == "__main__":
    main()
