"""Fuzzing the parsers: random and mutated manifests and chunk objects raise only the project's
own errors (or parse), never anything else."""

from __future__ import annotations

import json
import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.chunk import apply_chunk, encode_chunk, unpack_chunk
from weightsync.codec import CODEC_FULL, CODEC_SPARSE, CODEC_XOR
from weightsync.dtypes import dtype_by_name
from weightsync.errors import WeightsyncError
from weightsync.manifest import ChunkRef, Manifest, TensorEntry, compute_digest, parse_manifest

# CI runs a bounded fuzz; WEIGHTSYNC_FUZZ_EXAMPLES=20000 runs a longer one.
FUZZ = settings(max_examples=int(os.environ.get("WEIGHTSYNC_FUZZ_EXAMPLES", "300")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
BF16 = dtype_by_name("bfloat16")


def _valid_manifest() -> bytes:
    tensors = (TensorEntry(name="w", dtype="bfloat16", shape=(8, 8), chunks=(
        ChunkRef(start=0, stop=40, codec="sparse", raw="a" * 32, object="b" * 32, key="chunks/bb/" + "b" * 32, size=99),
        ChunkRef(start=40, stop=64, codec="same", raw="c" * 32))),)
    return Manifest(model="m", version=3, parent=2, base=1, kind="delta", step=1, created_unix_ms=0,
                    tensors=tensors, digest=compute_digest(tensors)).to_bytes()


VALID_MANIFEST = _valid_manifest()
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def _parses_or_refuses(data: bytes) -> None:
    try:
        parse_manifest(data)
    except WeightsyncError:
        pass


@FUZZ
@given(st.binary(max_size=2000))
def test_random_bytes_as_manifest(data):
    _parses_or_refuses(data)


@FUZZ
@given(_json)
def test_random_json_as_manifest(doc):
    _parses_or_refuses(json.dumps(doc).encode())


@FUZZ
@given(st.data())
def test_mutated_manifest(data):
    doc = json.loads(VALID_MANIFEST)
    path = data.draw(st.sampled_from([
        ("version",), ("parent",), ("base",), ("kind",), ("step",), ("tensors", 0, "shape"),
        ("tensors", 0, "chunks", 0, "start"), ("tensors", 0, "chunks", 0, "stop"), ("tensors", 0, "chunks", 1, "start"),
        ("tensors", 0, "chunks", 0, "codec"), ("tensors", 0, "chunks", 0, "size"), ("tensors", 0, "name"),
        ("tensors", 0, "dtype"), ("format",), ("model",),
    ]))
    target = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = data.draw(_json)
    _parses_or_refuses(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    raw = bytearray(VALID_MANIFEST)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    _parses_or_refuses(bytes(raw))


def _objects():
    rng = np.random.default_rng(0)
    old = rng.integers(0, 2**16, 2000, dtype=np.uint16).view(np.uint8)
    out = []
    for density, parent in ((0.02, old), (0.9, old), (1.0, None)):
        new = old.copy()
        new.view(np.uint16)[rng.random(2000) < density] ^= 5
        codec_id, raw, obj, _ = encode_chunk(new, parent, BF16, 1)
        out.append((codec_id, raw, obj))
    assert [o[0] for o in out] == [CODEC_SPARSE, CODEC_XOR, CODEC_FULL]
    return old, out


OLD, OBJECTS = _objects()


@FUZZ
@given(st.data())
def test_mutated_chunk_objects(data):
    codec_id, raw, obj = data.draw(st.sampled_from(OBJECTS))
    mutated = bytearray(obj)
    for _ in range(data.draw(st.integers(1, 6))):
        mutated[data.draw(st.integers(0, len(mutated) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        mutated = mutated[: data.draw(st.integers(0, len(mutated)))]
    out = OLD.copy()
    try:
        unpack_chunk(bytes(mutated))
        apply_chunk(bytes(mutated), out, BF16, raw, codec_id)
    except WeightsyncError:
        pass


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_as_chunk(data):
    try:
        apply_chunk(b"WSCK" + data, OLD.copy(), BF16, "0" * 32, CODEC_SPARSE)
    except WeightsyncError:
        pass
