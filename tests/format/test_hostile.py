"""Hostile inputs: every file in tests/hostile/ is refused with the error class and message that
expected.json names (always a WeightsyncError subclass, never a bare ValueError, KeyError,
IndexError, zstd, recursion or memory error), a refused chunk leaves its output range untouched
unless the failure is only detectable after decoding, and a hostile manifest in a store breaks
nothing else there. Inputs too big to commit (a manifest over the size cap, nesting right at the
interpreter's recursion limit) are built here at test time. The corpus is written by
tests/hostile/make_hostile.py."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from weightsync import errors
from weightsync.format.chunk import apply_chunk, unpack_chunk
from weightsync.format.dtypes import dtype_by_name
from weightsync.format.manifest import MAX_MANIFEST_BYTES, parse_manifest
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.stores import LocalStore
from weightsync.stores.retention import plan_gc
from weightsync.versions import list_versions

HOSTILE = Path(__file__).parents[1] / "hostile"
EXPECTED = json.loads((HOSTILE / "expected.json").read_text())
MANIFESTS = sorted(name for name, spec in EXPECTED.items() if spec["kind"] == "manifest")
CHUNKS = sorted(name for name, spec in EXPECTED.items() if spec["kind"] == "chunk")


@pytest.fixture(scope="module")
def make_hostile():
    """The generator script, imported from its file (tests/hostile is not a package)."""
    spec = importlib.util.spec_from_file_location("make_hostile", HOSTILE / "make_hostile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parent(spec: dict) -> np.ndarray:
    """The bytes the output range holds before the chunk is applied (make_hostile.parent)."""
    itemsize = dtype_by_name(spec["dtype"]).itemsize
    assert itemsize == 2, "every hostile chunk is built around 2-byte elements"
    rng = np.random.default_rng(spec["parent_seed"])
    return rng.integers(0, 2**16, spec["count"], dtype=np.uint16).view(np.uint8).copy()


def test_corpus_is_complete_and_small():
    files = {p.name for p in HOSTILE.iterdir() if p.suffix in (".json", ".bin") and p.name != "expected.json"}
    assert files == set(EXPECTED)
    assert len(MANIFESTS) >= 60 and len(CHUNKS) >= 40
    for name in files:
        assert (HOSTILE / name).stat().st_size < 100_000, name
    for spec in EXPECTED.values():
        assert issubclass(getattr(errors, spec["error"]), errors.WeightsyncError)


def test_committed_manifests_are_what_the_script_writes(make_hostile):
    # Manifest files do not depend on zstd, so they must regenerate byte for byte. (Chunk files
    # embed zstd frames and may legitimately differ after a zstandard upgrade.)
    for name, (data, error, match) in make_hostile.manifests().items():
        assert (HOSTILE / name).read_bytes() == data, name
        assert EXPECTED[name] == {"kind": "manifest", "error": error, "match": match}


@pytest.mark.parametrize("name", MANIFESTS)
def test_hostile_manifest_is_refused_with_a_clear_error(name):
    spec = EXPECTED[name]
    with pytest.raises(getattr(errors, spec["error"]), match=re.escape(spec["match"])) as info:
        parse_manifest((HOSTILE / name).read_bytes())
    assert isinstance(info.value, errors.WeightsyncError)


@pytest.mark.parametrize("name", CHUNKS)
def test_hostile_chunk_is_refused_with_a_clear_error(name):
    spec = EXPECTED[name]
    data = (HOSTILE / name).read_bytes()
    error = getattr(errors, spec["error"])
    if spec["stage"] == "unpack":
        with pytest.raises(error, match=re.escape(spec["match"])):
            unpack_chunk(data)
    else:
        header, payload = unpack_chunk(data)  # the framing is valid: the failure comes later
        assert len(payload) == header.payload_bytes
    parent = _parent(spec)
    out = parent.copy()
    with pytest.raises(error, match=re.escape(spec["match"])) as info:
        apply_chunk(data, out, dtype_by_name(spec["dtype"]), spec["raw"], spec["codec"])
    assert isinstance(info.value, errors.WeightsyncError)
    if not spec["touches"]:
        assert np.array_equal(out, parent), "a chunk refused before decoding must not touch the range"


def test_oversized_manifest_is_refused_before_parsing():
    valid = (HOSTILE / "manifest_bad_digest.json").read_bytes()  # any real manifest, padded past the cap
    data = valid + b" " * (MAX_MANIFEST_BYTES + 1 - len(valid))
    with pytest.raises(errors.FormatError, match=re.escape(f"manifest of {MAX_MANIFEST_BYTES + 1} bytes exceeds")):
        parse_manifest(data)
    at_cap = data[:MAX_MANIFEST_BYTES]  # exactly at the cap: not refused for its size
    with pytest.raises(errors.WeightsyncError) as info:
        parse_manifest(at_cap)
    assert "exceeds" not in str(info.value)


@pytest.mark.parametrize("field", ["producer", "stats"])
def test_manifest_nested_up_to_the_recursion_limit_is_refused_cleanly(field):
    """Nesting deep enough that json.loads still succeeds but re-encoding it (the size check on
    producer/stats, the canonical check) runs out of stack: must be a FormatError, not a bare
    RecursionError. Swept over every depth, since where the window lies depends on the stack."""
    valid = (HOSTILE / "manifest_bad_digest.json").read_bytes()
    prefix, rest = valid.split(f'"{field}":'.encode(), 1)
    suffix = rest[rest.index(b"}") + 1 :]
    bare = []
    for depth in range(1, sys.getrecursionlimit() + 10):
        data = prefix + f'"{field}":{{"x":'.encode() + b"[" * depth + b"]" * depth + b"}" + suffix
        try:
            parse_manifest(data)
        except errors.WeightsyncError:
            pass
        except RecursionError:
            bare.append(depth)
    assert not bare, f"bare RecursionError from parse_manifest at {field} nesting depths {bare[0]}..{bare[-1]}"


def test_a_hostile_manifest_in_a_store_breaks_only_itself(tmp_path):
    store = LocalStore(tmp_path)
    state = {"w": torch.randn(64, 64), "b": torch.randn(64)}
    with Publisher(store, model="hostile", config=PublisherConfig(chunk_bytes=4096)) as publisher:
        for _ in range(3):
            publisher.publish(state).result()
            state = {k: v + 1e-2 * torch.randn_like(v) for k, v in state.items()}
    before = sorted((i.key, i.size) for i in store.list())
    bad_key = "models/hostile/versions/000000000004.json"
    store.put_new(bad_key, (HOSTILE / "manifest_traversal_key.json").read_bytes())

    reader = Reader(store, model="hostile")
    with pytest.raises(errors.FormatError, match="content address"):
        reader.read(4)
    for version in (1, 2, 3):  # the good versions still read
        reader.read(version)
    with pytest.raises(errors.FormatError, match="nothing deleted"):
        plan_gc(store, "hostile", keep=1, grace_s=0)
    after = sorted((i.key, i.size) for i in store.list() if i.key != bad_key)
    assert after == before and list_versions(store, "hostile") == [1, 2, 3, 4]


@pytest.mark.parametrize(
    "state, error, match",
    [
        ({"../escape": torch.ones(2)}, errors.FormatError, "'..' path segment"),
        ({"/abs": torch.ones(2)}, errors.FormatError, "absolute"),
        ({"c": torch.ones(2, dtype=torch.complex64)}, errors.UnsupportedFormatError, "unsupported dtype"),
        ({"n": [1.0, 2.0]}, errors.LayoutError, "not a tensor"),
        ({"s": torch.ones(3).to_sparse()}, errors.LayoutError, "dense"),
    ],
    ids=["traversal", "absolute", "complex", "list", "sparse"],
)
def test_hostile_state_dicts_are_refused_before_anything_is_written(tmp_path, state, error, match):
    store = LocalStore(tmp_path / "store")
    with Publisher(store, model="hostile") as publisher, pytest.raises(error, match=re.escape(match)):
        publisher.publish({"ok": torch.ones(4), **state})
    assert list(store.list()) == []
