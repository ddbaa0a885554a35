"""Fuzzing the two parsers of untrusted bytes, `parse_manifest` and `unpack_chunk` + `apply_chunk`.

Inputs are random bytes, random JSON-ish documents, manifest-shaped documents with random field
values, and mutations of valid manifests and chunk objects (flipped, deleted, inserted bytes;
deleted, duplicated and renamed keys; changed numbers; rewritten header fields and stream tables,
re-hashed so that the mutation reaches the decoder instead of stopping at the hash check).
Properties: the only exceptions are WeightsyncError subclasses; a manifest that parses re-encodes
to exactly its input bytes and matches its digest; a chunk refused with a FormatError has not
touched its output range, and one that applies produced bytes matching its raw hash.

Bounded for CI (a few hundred examples per test, no deadline).
"""

from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from weightsync.errors import FormatError, WeightsyncError
from weightsync.format.chunk import HEADER, HEADER_SIZE, apply_chunk, encode_chunk, unpack_chunk
from weightsync.format.codecs import CODEC_CTX, CODEC_FULL, CODEC_RANS, CODEC_SPARSE, CODEC_XOR
from weightsync.format.codecs.choice import CodecChoice
from weightsync.format.dtypes import BY_CODE, dtype_by_name
from weightsync.format.hashing import xxh3_digest
from weightsync.format.layout import chunk_key
from weightsync.format.manifest import (
    ChunkRef,
    Manifest,
    TensorEntry,
    canonical_json,
    compute_digest,
    parse_manifest,
)

# CI runs a bounded fuzz; WEIGHTSYNC_FUZZ_EXAMPLES=20000 runs a longer one.
FUZZ = settings(
    max_examples=int(os.environ.get("WEIGHTSYNC_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
HEADER_FIELDS = [
    "magic",
    "fmt",
    "codec",
    "level",
    "dtype",
    "flags",
    "hsize",
    "reserved",
    "count",
    "plen",
    "raw",
    "phash",
]

# ----------------------------------------------------------------------------------- manifests


def _valid_manifests() -> list[bytes]:
    obj = "ab" * 16
    delta_tensors = (
        TensorEntry(
            name="layers.0.w",
            dtype="bfloat16",
            shape=(8, 8),
            chunks=(
                ChunkRef(start=0, stop=40, codec="sparse", raw="a" * 32, object=obj, key=chunk_key(obj), size=99),
                ChunkRef(start=40, stop=50, codec="xor", raw="b" * 32, object=obj, key=chunk_key(obj), size=80),
                ChunkRef(start=50, stop=64, codec="same", raw="c" * 32),
            ),
        ),
        TensorEntry(name="layers.0/empty", dtype="float32", shape=(0, 4), chunks=()),
        TensorEntry(
            name="scale", dtype="int64", shape=(), chunks=(ChunkRef(start=0, stop=1, codec="same", raw="d" * 32),)
        ),
    )
    full_tensors = tuple(
        TensorEntry(
            name=t.name,
            dtype=t.dtype,
            shape=t.shape,
            chunks=tuple(
                ChunkRef(start=c.start, stop=c.stop, codec="full", raw=c.raw, object=obj, key=chunk_key(obj), size=120)
                for c in t.chunks
            ),
        )
        for t in delta_tensors
    )
    delta = Manifest(
        model="org/m",
        version=3,
        parent=2,
        base=1,
        kind="delta",
        step=11,
        created_unix_ms=5,
        tensors=delta_tensors,
        digest=compute_digest(delta_tensors),
        producer={"name": "weightsync", "nested": {"a": [1, 2, None]}},
        stats={"changed": 3},
    )
    full = Manifest(
        model="m",
        version=1,
        parent=None,
        base=1,
        kind="full",
        step=None,
        created_unix_ms=0,
        tensors=full_tensors,
        digest=compute_digest(full_tensors),
    )
    out = [delta.to_bytes(), full.to_bytes()]
    for data in out:
        parse_manifest(data)  # the seeds themselves are valid
    return out


VALID_MANIFESTS = _valid_manifests()
VOCAB = [
    "format",
    "model",
    "version",
    "parent",
    "base",
    "kind",
    "step",
    "created_unix_ms",
    "tensors",
    "digest",
    "producer",
    "stats",
    "name",
    "dtype",
    "shape",
    "chunks",
    "start",
    "stop",
    "codec",
    "raw",
    "object",
    "key",
    "size",
    "same",
    "full",
    "delta",
    "sparse",
    "xor",
    "bfloat16",
    "../x",
    "/abs",
    "",
]
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 2**46, 2**46 + 1, 2**63, 10**12, 64, 65])
    | st.text(max_size=20)
    | st.sampled_from(VOCAB)
    | st.sampled_from(["a" * 32, "A" * 32, chunk_key("ab" * 16)])
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8) | st.sampled_from(VOCAB), inner, max_size=5)
    ),
    max_leaves=30,
)


def _redigest(doc) -> None:
    """Best effort: fixes the digest of a mutated document so the parser checks what comes after it."""
    try:
        tensors = [
            TensorEntry(
                name=t["name"],
                dtype=t["dtype"],
                shape=tuple(t["shape"]),
                chunks=tuple(ChunkRef(**c) for c in t["chunks"]),
            )
            for t in doc["tensors"]
        ]
        digest = compute_digest(tensors)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return  # too broken to digest: the parser must refuse it some other way
    doc["digest"] = digest


def _check_manifest(data: bytes) -> None:
    """parse_manifest either refuses with a WeightsyncError or returns a manifest equal to its bytes."""
    try:
        manifest = parse_manifest(data)
    except WeightsyncError as e:
        words = re.sub(r"[^a-z ]", " ", str(e)).split()[:4]
        event(f"refused: {type(e).__name__}: {' '.join(words)}")
        return
    event("parsed")
    assert manifest.to_bytes() == data
    assert compute_digest(manifest.tensors) == manifest.digest
    assert parse_manifest(manifest.to_bytes()) == manifest


@FUZZ
@given(st.binary(max_size=3000))
def test_random_bytes_as_manifest(data):
    _check_manifest(data)


@FUZZ
@given(doc=_json, canonical=st.booleans())
def test_random_json_as_manifest(doc, canonical):
    _check_manifest(canonical_json(doc) if canonical else json.dumps(doc).encode())


@st.composite
def _manifest_shaped(draw):
    """A document with a manifest's keys and nesting: mostly consistent values, with a drawn amount
    of noise (a value replaced by a random scalar, a key dropped) so every check gets reached."""
    noise = draw(st.integers(0, 3))

    def value(plausible):
        return draw(_scalars) if draw(st.integers(0, 24)) < noise else draw(plausible)

    kind = value(st.sampled_from(["full", "delta"]))
    version = value(st.integers(2, 6))
    v = version if isinstance(version, int) and not isinstance(version, bool) and version >= 2 else 2
    parent = value(st.none() | st.integers(1, v - 1)) if kind == "full" else value(st.integers(1, v - 1))
    p = parent if isinstance(parent, int) and not isinstance(parent, bool) and 1 <= parent < v else 1
    base = value(st.just(v)) if kind == "full" else value(st.integers(1, p))
    codecs = ["full"] if kind == "full" else ["full", "xor", "sparse", "ctx", "same"]

    def chunk(start, numel):
        stop = value(st.integers(start + 1, min(start + 70, numel)))
        doc = {
            "start": start,
            "stop": stop,
            "codec": value(st.sampled_from(codecs)),
            "raw": value(st.sampled_from(["a" * 32, "0" * 32])),
        }
        if doc["codec"] != "same" or draw(st.integers(0, 20)) < noise:
            obj = value(st.sampled_from(["ab" * 16, "cd" * 16]))
            doc.update(
                object=obj,
                key=value(st.just(chunk_key(obj) if isinstance(obj, str) else "x")),
                size=value(st.integers(65, 4160)),
            )
        return doc

    tensors = []
    for i in range(draw(st.integers(0, 3))):
        shape = value(st.lists(st.integers(0, 9), max_size=3))
        numel = int(np.prod(shape)) if isinstance(shape, list) and all(type(s) is int for s in shape) else 5
        chunks, start = [], 0
        while start < numel and len(chunks) < 6:
            chunks.append(chunk(start, numel))
            stop = chunks[-1]["stop"]
            start = stop if type(stop) is int and stop > start else numel
        tensors.append(
            {
                "name": value(st.sampled_from([f"t{i}", f"t{i}/a.b"])),
                "dtype": value(st.sampled_from(["bfloat16", "float32", "int64", "bool", "float8_e5m2"])),
                "shape": shape,
                "chunks": value(st.just(chunks)),
            }
        )
    doc = {
        "format": value(st.just(1)),
        "model": value(st.sampled_from(["m", "org/m.v2"])),
        "version": version,
        "parent": parent,
        "base": base,
        "kind": kind,
        "step": value(st.none() | st.integers(0, 10)),
        "created_unix_ms": value(st.integers(0, 10**13)),
        "tensors": tensors,
        "digest": "0" * 32,
        "producer": value(st.just({})),
        "stats": value(st.dictionaries(st.text(max_size=3), st.integers())),
    }
    if draw(st.integers(0, 9)) < noise:
        del doc[draw(st.sampled_from(sorted(doc)))]
    return doc


@FUZZ
@given(doc=_manifest_shaped(), redigest=st.booleans())
def test_manifest_shaped_documents(doc, redigest):
    if redigest:
        _redigest(doc)
    _check_manifest(canonical_json(doc))


_NUMBER = re.compile(rb"(?<![0-9a-z\"])-?[0-9]+(?![0-9a-z\"])")
_NUMBER_TEXTS = [
    b"0",
    b"-1",
    b"1.0",
    b"1e3",
    b"-0",
    b"007",
    b"99999999999999999999999999",
    b"NaN",
    b"Infinity",
    b"true",
    b"null",
    b'"1"',
    b"[]",
    b"{}",
    b"1" * 5000,
    b"18446744073709551616",
]


@FUZZ
@given(data=st.data(), which=st.sampled_from(range(len(VALID_MANIFESTS))))
def test_mutated_manifest_bytes(data, which):
    raw = bytearray(VALID_MANIFESTS[which])
    how = data.draw(st.sampled_from(["flip", "delete", "insert", "truncate", "number", "duplicate", "drop-key"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    elif how == "delete":
        start = data.draw(st.integers(0, len(raw) - 1))
        del raw[start : start + data.draw(st.integers(1, 20))]
    elif how == "insert":
        raw[data.draw(st.integers(0, len(raw))) : 0] = data.draw(
            st.sampled_from([b",", b"{", b"]", b'"', b"\\", b"\x00", b" ", b"\xff", b'"x":1,', b'{"a":', b"\\ud800"])
        )
    elif how == "truncate":
        del raw[data.draw(st.integers(0, len(raw) - 1)) :]
    elif how == "number":  # replace one integer literal with something else
        numbers = list(_NUMBER.finditer(raw))
        m = numbers[data.draw(st.integers(0, len(numbers) - 1))]
        raw[m.start() : m.end()] = data.draw(st.sampled_from(_NUMBER_TEXTS))
    elif how == "duplicate":  # a key repeated textually, in any object
        keys = list(re.finditer(rb'"([a-z_]+)":', raw))
        m = keys[data.draw(st.integers(0, len(keys) - 1))]
        raw[m.start() : m.start()] = m.group(0) + b"0,"
    else:  # a key (and its value) removed at the JSON level, digest recomputed
        doc = json.loads(raw)
        path = data.draw(
            st.sampled_from([(), ("tensors", 0), ("tensors", 0, "chunks", 0), ("tensors", 0, "chunks", 2)])
        )
        target = doc
        for part in path:
            target = target[part]
        del target[data.draw(st.sampled_from(sorted(target)))]
        _redigest(doc)
        raw = bytearray(canonical_json(doc))
    _check_manifest(bytes(raw))


@FUZZ
@given(data=st.data(), which=st.sampled_from(range(len(VALID_MANIFESTS))))
def test_mutated_manifest_values(data, which):
    """One field anywhere in a valid manifest replaced by a random value, the digest recomputed."""
    doc = json.loads(VALID_MANIFESTS[which])
    paths = (
        [(k,) for k in doc]
        + [("tensors", i, k) for i, t in enumerate(doc["tensors"]) for k in t]
        + [
            ("tensors", i, "chunks", j, k)
            for i, t in enumerate(doc["tensors"])
            for j, c in enumerate(t["chunks"])
            for k in c
        ]
        + [("tensors", 0, "shape", 0)]
    )
    path = data.draw(st.sampled_from(paths))
    target = doc
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = data.draw(_json)
    _redigest(doc)
    _check_manifest(canonical_json(doc))


# -------------------------------------------------------------------------------------- chunks


def _valid_objects() -> list[tuple[np.ndarray, int, str, bytes, str]]:
    """(parent bytes, codec id, raw hex, object, dtype name) for every codec and itemsize."""
    out = []
    rng = np.random.default_rng(0)
    for name, count in (("uint8", 301), ("bfloat16", 1000), ("float32", 257), ("int64", 130)):
        dtype = dtype_by_name(name)
        old = rng.integers(0, 256, count * dtype.itemsize, dtype=np.uint8)
        for density, parent, ctx in ((0.03, old, True), (0.05, old, False), (0.8, old, True), (1.0, None, True)):
            new = old.copy()
            words = new.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize])
            words[rng.random(count) < density] ^= 5
            words[-1] ^= 3  # at least one change
            choice = CodecChoice(highest_codec=CODEC_RANS if ctx else CODEC_SPARSE)
            codec_id, raw_hex, obj, _ = encode_chunk(new, parent, dtype, 1, choice=choice)
            out.append((old, codec_id, raw_hex, obj, name))
    assert {o[1] for o in out} == {CODEC_FULL, CODEC_XOR, CODEC_SPARSE, CODEC_CTX}
    return out


OBJECTS = _valid_objects()


def _check_chunk(obj: bytes, parent: np.ndarray, dtype_name: str, raw_hex: str, codec_id: int) -> None:
    out = parent.copy()
    try:
        unpack_chunk(obj)
    except WeightsyncError:
        pass
    try:
        apply_chunk(obj, out, dtype_by_name(dtype_name), raw_hex, codec_id)
    except FormatError:  # framing and stream faults are all found before a byte is written
        assert np.array_equal(out, parent)
    except WeightsyncError:
        pass
    else:
        assert xxh3_digest(out).hex() == raw_hex == unpack_chunk(obj)[0].raw_xxh3.hex()


def _repack(obj: bytes, payload: bytes | None = None, **fields) -> bytes:
    """`obj` with header fields replaced; a payload gets its correct length and hash unless overridden."""
    values = dict(zip(HEADER_FIELDS, HEADER.unpack_from(obj, 0), strict=True))
    body = obj[HEADER_SIZE:] if payload is None else payload
    values.update(plen=len(body), phash=xxh3_digest(body))
    values.update(fields)
    return HEADER.pack(*[values[n] for n in HEADER_FIELDS]) + body


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_as_chunk(data):
    parent, codec_id, raw_hex, _, name = OBJECTS[1]
    _check_chunk(data, parent, name, raw_hex, codec_id)
    _check_chunk(b"WSCK\x01\x00" + data, parent, name, raw_hex, codec_id)


@FUZZ
@given(
    payload=st.binary(max_size=400),
    codec_id=st.sampled_from([CODEC_FULL, CODEC_XOR, CODEC_SPARSE]),
    dtype_code=st.sampled_from(sorted(BY_CODE)),
    count=st.integers(0, 64),
    level=st.integers(0, 22),
)
def test_random_payload_behind_a_valid_header(payload, codec_id, dtype_code, count, level):
    """A well-formed header (hashes right) over a random payload: the decoder itself is fuzzed."""
    dtype = BY_CODE[dtype_code]
    raw = b"\x11" * 16
    header = HEADER.pack(
        b"WSCK", 1, codec_id, level, dtype_code, 0, 64, 0, count, len(payload), raw, xxh3_digest(payload)
    )
    parent = np.zeros(count * dtype.itemsize, dtype=np.uint8)
    _check_chunk(header + payload, parent, dtype.name, raw.hex(), codec_id)


@FUZZ
@given(data=st.data(), which=st.sampled_from(range(len(OBJECTS))))
def test_mutated_chunk_objects(data, which):
    parent, codec_id, raw_hex, obj, name = OBJECTS[which]
    payload = bytearray(obj[HEADER_SIZE:])
    how = data.draw(st.sampled_from(["raw-flip", "payload-flip", "payload-cut", "payload-extend", "table", "header"]))
    if how == "raw-flip":  # no re-hashing: the hash checks must catch it
        mutated = bytearray(obj)
        for _ in range(data.draw(st.integers(1, 6))):
            mutated[data.draw(st.integers(0, len(mutated) - 1))] = data.draw(st.integers(0, 255))
        if data.draw(st.booleans()):
            mutated = mutated[: data.draw(st.integers(0, len(mutated)))]
        candidate = bytes(mutated)
    elif how == "payload-flip":  # re-hashed: the decoder sees the corrupt streams
        for _ in range(data.draw(st.integers(1, 4))):
            payload[data.draw(st.integers(0, len(payload) - 1))] ^= data.draw(st.integers(1, 255))
        candidate = _repack(obj, bytes(payload))
    elif how == "payload-cut":
        start = data.draw(st.integers(0, len(payload) - 1))
        del payload[start : start + data.draw(st.integers(1, 40))]
        candidate = _repack(obj, bytes(payload))
    elif how == "payload-extend":
        payload[data.draw(st.integers(0, len(payload))) : 0] = data.draw(st.binary(min_size=1, max_size=40))
        candidate = _repack(obj, bytes(payload))
    elif how == "table" and codec_id == CODEC_CTX:  # no stream table: its changed count or class base
        if data.draw(st.booleans()):
            struct.pack_into(
                "<Q", payload, 0, data.draw(st.sampled_from([0, 1, 2**32, 2**64 - 1]) | st.integers(0, 5000))
            )
        else:
            struct.pack_into("<H", payload, 8, data.draw(st.integers(0, 2**16 - 1)))
        candidate = _repack(obj, bytes(payload))
    elif how == "table":  # one stream's raw or compressed length rewritten
        n = payload[0]
        entry = data.draw(st.integers(0, n - 1))
        field = data.draw(st.integers(0, 1))
        value = data.draw(st.sampled_from([0, 1, 2, 3, 4, 255, 256, 2**31, 2**40, 2**64 - 1]) | st.integers(0, 5000))
        struct.pack_into("<Q", payload, 1 + 16 * entry + 8 * field, value)
        candidate = _repack(obj, bytes(payload))
    else:
        limits = {
            "fmt": 2**16 - 1,
            "codec": 255,
            "level": 255,
            "dtype": 255,
            "flags": 255,
            "hsize": 2**16 - 1,
            "reserved": 2**32 - 1,
            "count": 2**64 - 1,
            "plen": 2**64 - 1,
        }
        field = data.draw(st.sampled_from([*limits, "raw"]))
        value = (
            data.draw(st.binary(min_size=16, max_size=16))
            if field == "raw"
            else data.draw(st.integers(0, limits[field]) | st.sampled_from([0, 1, 2, 3]))
        )
        candidate = _repack(obj, **{field: value})
        if field == "plen":
            assume(value != len(payload))
    _check_chunk(candidate, parent, name, raw_hex, codec_id)
