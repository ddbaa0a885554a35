"""Writes the hostile-input corpus next to this file: malformed manifests and chunk objects, and
`expected.json`, which says for each file the error it must raise and a fragment of the message.

Deterministic: run `python tests/hostile/make_hostile.py` after a format change and commit the
result. tests/test_hostile.py checks every file listed.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import zstandard

from weightsync.chunk import HEADER, encode_chunk
from weightsync.codec import CODEC_SPARSE, CODEC_XOR
from weightsync.dtypes import dtype_by_name
from weightsync.hashing import xxh3_digest
from weightsync.layout import chunk_key
from weightsync.manifest import MAX_NDIM, ChunkRef, Manifest, TensorEntry, canonical_json, compute_digest

HERE = Path(__file__).resolve().parent
BF16 = dtype_by_name("bfloat16")
COUNT = 4096


def _valid_manifest_doc() -> dict:
    chunk = ChunkRef(start=0, stop=COUNT, codec="sparse", raw="a" * 32, object="b" * 32, key=chunk_key("b" * 32),
                     size=200)
    tensors = (
        TensorEntry(name="model.layers.0.weight", dtype="bfloat16", shape=(64, 64), chunks=(chunk,)),
        TensorEntry(name="model.norm.weight", dtype="float32", shape=(64,),
                    chunks=(ChunkRef(start=0, stop=64, codec="same", raw="c" * 32),)),
    )
    manifest = Manifest(model="hostile", version=5, parent=4, base=1, kind="delta", step=5,
                        created_unix_ms=1764000000000, tensors=tensors, digest=compute_digest(tensors),
                        producer={"name": "weightsync"}, stats={})
    return manifest.to_json()


def _redigest(doc: dict) -> dict:
    """Recomputes the digest so a test reaches the check it targets, not the digest check."""
    tensors = [TensorEntry(name=t["name"], dtype=t["dtype"], shape=tuple(t["shape"]) if isinstance(t["shape"], list) else t["shape"],
                           chunks=tuple(ChunkRef(**{k: v for k, v in c.items()}) for c in t["chunks"]))
               for t in doc["tensors"]]
    doc["digest"] = compute_digest(tensors)
    return doc


def manifests() -> dict[str, tuple[bytes, str, str]]:
    """file name -> (bytes, error class, message fragment)."""
    out: dict[str, tuple[bytes, str, str]] = {}

    def add(name, doc, error, match, redigest=True):
        if isinstance(doc, dict) and redigest:
            try:
                doc = _redigest(doc)
            except Exception:  # a doc too broken to digest keeps its old one
                pass
        data = doc if isinstance(doc, bytes) else canonical_json(doc)
        out[name] = (data, error, match)

    def mutate(fn):
        doc = _valid_manifest_doc()
        fn(doc)
        return doc

    add("manifest_overlapping_ranges.json", mutate(lambda d: d["tensors"][0].update(chunks=[
        {**d["tensors"][0]["chunks"][0], "stop": 3000}, {**d["tensors"][0]["chunks"][0], "start": 2000}])),
        "FormatError", "contiguous")
    add("manifest_missing_range.json", mutate(lambda d: d["tensors"][0]["chunks"][0].update(stop=4000)),
        "FormatError", "cover 4000 of its 4096")
    add("manifest_range_beyond_tensor.json", mutate(lambda d: d["tensors"][0]["chunks"][0].update(stop=5000)),
        "FormatError", "beyond")
    add("manifest_traversal_name.json", mutate(lambda d: d["tensors"][0].update(name="../../etc/passwd")),
        "FormatError", "'..' path segment")
    add("manifest_absolute_name.json", mutate(lambda d: d["tensors"][0].update(name="/etc/passwd")),
        "FormatError", "absolute")
    add("manifest_traversal_key.json", mutate(lambda d: d["tensors"][0]["chunks"][0].update(key="../../../x")),
        "FormatError", "content address")
    add("manifest_key_not_matching_object.json",
        mutate(lambda d: d["tensors"][0]["chunks"][0].update(key=chunk_key("d" * 32))), "FormatError", "content address")
    add("manifest_unknown_format.json", mutate(lambda d: d.update(format=99)), "UnsupportedFormatError",
        "supported: [1]")
    add("manifest_unknown_codec.json", mutate(lambda d: d["tensors"][0]["chunks"][0].update(codec="lz4")),
        "UnsupportedFormatError", "unknown codec")
    add("manifest_unknown_dtype.json", mutate(lambda d: d["tensors"][0].update(dtype="complex64")),
        "UnsupportedFormatError", "unsupported dtype")
    add("manifest_unknown_field.json", mutate(lambda d: d.update(extra=1)), "FormatError", "unknown fields ['extra']")
    add("manifest_float_number.json", canonical_json(_valid_manifest_doc()).replace(b'"step":5', b'"step":5.0'),
        "FormatError", "integers")
    add("manifest_nan_constant.json", canonical_json(_valid_manifest_doc()).replace(b'"step":5', b'"step":NaN'),
        "FormatError", "integers")
    add("manifest_duplicate_key.json", canonical_json(_valid_manifest_doc()).replace(b'"step":5', b'"step":5,"step":6'),
        "FormatError", "duplicate")
    add("manifest_not_canonical.json", json.dumps(_valid_manifest_doc(), indent=1).encode(), "FormatError", "canonical")
    add("manifest_bad_digest.json", mutate(lambda d: d.update(digest="e" * 32)), "IntegrityError", "digest",
        redigest=False)
    add("manifest_huge_shape.json", mutate(lambda d: d["tensors"][0].update(shape=[2**40, 2**40])),
        "FormatError", "exceeds")
    add("manifest_too_many_dims.json", mutate(lambda d: d["tensors"][0].update(shape=[1] * (MAX_NDIM + 1))),
        "FormatError", "at most 64")
    add("manifest_negative_size.json", mutate(lambda d: d["tensors"][0].update(shape=[-64, -64])),
        "FormatError", "shape")
    add("manifest_chunk_too_big.json", mutate(lambda d: d["tensors"][0].update(shape=[2**26]) or
                                                 d["tensors"][0]["chunks"][0].update(stop=2**26)),
        "FormatError", "over the")
    add("manifest_oversized_object.json", mutate(lambda d: d["tensors"][0]["chunks"][0].update(size=2**40)),
        "FormatError", "size")
    add("manifest_delta_without_parent.json", mutate(lambda d: d.update(parent=None)), "FormatError",
        "base <= parent < version")
    add("manifest_parent_in_future.json", mutate(lambda d: d.update(parent=9)), "FormatError", "parent")
    add("manifest_full_with_same_chunk.json", mutate(lambda d: d.update(kind="full", base=5, parent=None)),
        "FormatError", "full version")
    add("manifest_unsorted_tensors.json", mutate(lambda d: d["tensors"].reverse()), "FormatError", "sorted")
    add("manifest_duplicate_tensor.json", mutate(lambda d: d["tensors"].insert(0, d["tensors"][0])),
        "FormatError", "unique")
    add("manifest_bad_model_name.json", mutate(lambda d: d.update(model="../x")), "FormatError", "model name")
    add("manifest_bool_version.json", canonical_json(_valid_manifest_doc()).replace(b'"version":5', b'"version":true'),
        "FormatError", "version")
    add("manifest_deep_nesting.json", b'{"format":1,"producer":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "FormatError", "JSON")
    add("manifest_not_json.json", b"\x00\xffnot json", "FormatError", "not valid JSON")
    add("manifest_array.json", b"[1,2,3]", "FormatError", "JSON object")
    return out


def chunks() -> dict[str, tuple[bytes, dict]]:
    """file name -> (object bytes, how to apply it and what it must raise)."""
    rng = np.random.default_rng(0)
    old = rng.integers(0, 2**16, COUNT, dtype=np.uint16).view(np.uint8)
    new = old.copy()
    new.view(np.uint16)[::50] ^= 1
    codec_id, raw_hex, good, _ = encode_chunk(new, old, BF16, 1)
    assert codec_id == CODEC_SPARSE
    base = {"dtype": "bfloat16", "count": COUNT, "raw": raw_hex, "codec": codec_id, "parent_seed": 0}
    out: dict[str, tuple[bytes, dict]] = {}

    def add(name, data, error, match, **overrides):
        out[name] = (data, {**base, "error": error, "match": match, **overrides})

    def header(**fields):
        names = ["magic", "fmt", "codec", "level", "dtype", "flags", "hsize", "count", "plen", "raw", "phash"]
        values = dict(zip(names, HEADER.unpack_from(good, 0)))
        values.update(fields)
        payload = good[64:]
        if "payload" in fields:
            payload = fields.pop("payload")
            values.pop("payload")
            values["plen"] = len(payload)
            values["phash"] = xxh3_digest(payload)
        return HEADER.pack(*[values[n] for n in names]) + payload

    add("chunk_truncated_header.bin", good[:40], "FormatError", "shorter than")
    add("chunk_truncated_payload.bin", good[:-5], "FormatError", "declares")
    add("chunk_oversized.bin", good + b"\0" * 100, "FormatError", "declares")
    add("chunk_bad_magic.bin", b"NOPE" + good[4:], "FormatError", "not a weightsync chunk")
    add("chunk_unknown_version.bin", header(fmt=7), "UnsupportedFormatError", "supported: [1]")
    add("chunk_unknown_codec.bin", header(codec=9), "UnsupportedFormatError", "unknown codec")
    add("chunk_unknown_dtype.bin", header(dtype=200), "UnsupportedFormatError", "dtype code")
    add("chunk_nonzero_flags.bin", header(flags=1), "FormatError", "flags")
    add("chunk_too_many_elements.bin", header(count=2**40), "FormatError", "limit")
    add("chunk_payload_hash_mismatch.bin", good[:-1] + bytes([good[-1] ^ 1]), "IntegrityError", "payload")
    add("chunk_raw_hash_mismatch.bin", good, "IntegrityError", "decoded to bytes", parent_seed=1)
    add("chunk_manifest_raw_mismatch.bin", good, "IntegrityError", "raw hash differs", raw="0" * 32)
    add("chunk_wrong_dtype.bin", good, "FormatError", "does not match tensor dtype", dtype="float16")
    add("chunk_wrong_count.bin", good, "FormatError", "elements", count=COUNT - 1)
    add("chunk_codec_mismatch.bin", good, "FormatError", "differs from the manifest", codec=CODEC_XOR)

    def streams(*frames_and_lens):
        table = b"".join(struct.pack("<QQ", raw_len, len(frame)) for frame, raw_len in frames_and_lens)
        return bytes([len(frames_and_lens)]) + table + b"".join(f for f, _ in frames_and_lens)

    c = zstandard.ZstdCompressor(level=1)
    n = 82  # changed elements the sparse payload declares
    gaps = c.compress(bytes([49] * n))
    lo, hi = c.compress(bytes([1] * n)), c.compress(bytes(n))
    # A frame that claims 1 GiB while the table says n bytes.
    bomb_claims = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 20))
    bomb_claims = bomb_claims[:4] + bomb_claims[4:]  # real frame of 1 MiB content size
    add("chunk_zstd_bomb_claims.bin", header(payload=streams((gaps, n), (b"", 0), (bomb_claims, n), (hi, n))),
        "FormatError", "claims")
    # A frame without a content size that expands far past what the table declares.
    no_size = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(bytes(8 << 20))
    add("chunk_zstd_bomb_expands.bin", header(payload=streams((gaps, n), (b"", 0), (no_size, n), (hi, n))),
        "FormatError", "stream 2")
    add("chunk_trailing_garbage.bin", header(payload=streams((gaps, n), (b"", 0), (lo, n), (hi, n)) + b"junk"),
        "FormatError", "trailing")
    add("chunk_stream_count.bin", header(payload=streams((gaps, n), (lo, n), (hi, n))), "FormatError", "streams")
    add("chunk_not_zstd.bin", header(payload=streams((b"garbage!" * 4, n), (b"", 0), (lo, n), (hi, n))),
        "FormatError", "not a zstd frame")
    far = c.compress(bytes([255] * n))
    overflow = c.compress(np.full(4 * n, 0, np.uint8).tobytes())
    add("chunk_sparse_position_out_of_range.bin",
        header(payload=streams((far, n), (c.compress(b"\xff" * n + b"\0" * 3 * n), 4 * n), (lo, n), (hi, n))),
        "FormatError", "outside the chunk")
    add("chunk_sparse_overflow_length.bin", header(payload=streams((far, n), (overflow[:0], 0), (lo, n), (hi, n))),
        "FormatError", "overflow")
    huge = zstandard.ZstdCompressor(level=19).compress(bytes(1 << 20))  # claims 1 MiB; the table claims 1 TiB
    add("chunk_sparse_overflow_claims_huge.bin", header(payload=streams((far, n), (huge, 1 << 40), (lo, n), (hi, n))),
        "FormatError", "stream 1 declares")
    add("chunk_sparse_too_many_changes.bin", header(payload=streams((gaps, COUNT + 1), (b"", 0), (lo, n), (hi, n))),
        "FormatError", "changed elements")
    add("chunk_full_codec_short_plane.bin", header(codec=1, payload=streams((lo, n), (hi, n))), "FormatError",
        "expected 4096", codec=1)
    return out


def main() -> None:
    expected = {}
    for name, (data, error, match) in manifests().items():
        (HERE / name).write_bytes(data)
        expected[name] = {"kind": "manifest", "error": error, "match": match}
    for name, (data, spec) in chunks().items():
        (HERE / name).write_bytes(data)
        expected[name] = {"kind": "chunk", **spec}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(expected)} hostile inputs to {HERE}")


if __name__ == "__main__":
    main()
