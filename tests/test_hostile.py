"""Every file in tests/hostile/ is refused with the error expected.json names (a subclass of the
project's WeightsyncError, never a bare ValueError, zstd or recursion error), changes nothing it
was applied to, and a hostile manifest in a store breaks nothing else there."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from weightsync import errors
from weightsync.chunk import apply_chunk, unpack_chunk
from weightsync.dtypes import dtype_by_name
from weightsync.manifest import MAX_MANIFEST_BYTES, parse_manifest
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.retention import plan_gc
from weightsync.store import LocalStore
from weightsync.versions import list_versions

HOSTILE = Path(__file__).parent / "hostile"
EXPECTED = json.loads((HOSTILE / "expected.json").read_text())


def test_corpus_is_complete():
    files = {p.name for p in HOSTILE.iterdir() if p.suffix in (".json", ".bin") and p.name != "expected.json"}
    assert files == set(EXPECTED)
    assert len(EXPECTED) >= 50


def _parent(spec: dict) -> np.ndarray:
    itemsize = dtype_by_name(spec["dtype"]).itemsize
    rng = np.random.default_rng(spec["parent_seed"])
    return rng.integers(0, 256, spec["count"] * itemsize, dtype=np.uint8) if spec["parent_seed"] else \
        np.random.default_rng(0).integers(0, 2**16, spec["count"], dtype=np.uint16).view(np.uint8).copy()


@pytest.mark.parametrize("name", sorted(EXPECTED), ids=str)
def test_hostile_input_is_refused_with_a_clear_error(name):
    spec = EXPECTED[name]
    data = (HOSTILE / name).read_bytes()
    error = getattr(errors, spec["error"])
    if spec["kind"] == "manifest":
        with pytest.raises(error, match=re.escape(spec["match"])) as info:
            parse_manifest(data)
    else:
        parent = _parent(spec)
        out = parent.copy()
        with pytest.raises(error, match=re.escape(spec["match"])) as info:
            apply_chunk(data, out, dtype_by_name(spec["dtype"]), spec["raw"], spec["codec"])
        if spec["error"] != "IntegrityError" or "decoded" not in spec["match"]:
            assert np.array_equal(out, parent), "a refused chunk must not touch the buffer"
    assert isinstance(info.value, errors.WeightsyncError)


def test_oversized_manifest_is_refused_before_parsing():
    with pytest.raises(errors.FormatError, match="exceeds"):
        parse_manifest(b" " * (MAX_MANIFEST_BYTES + 1))


def test_chunk_framing_errors_leave_the_header_parser_consistent():
    for name, spec in EXPECTED.items():
        if spec["kind"] == "chunk" and spec["match"] in ("shorter than", "declares", "not a weightsync chunk"):
            with pytest.raises(errors.FormatError):
                unpack_chunk((HOSTILE / name).read_bytes())


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
    with Publisher(store, model="hostile") as publisher:
        with pytest.raises(error, match=re.escape(match)):
            publisher.publish({"ok": torch.ones(4), **state})
    assert list(store.list()) == []
