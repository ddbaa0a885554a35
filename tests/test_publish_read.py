"""Publisher and Reader end to end on a LocalStore: what is published reads back bit for bit.

Covers successive deltas, dtypes kept or cast, rebase rules, the in-flight bound and commit
order, continuing from a store, `Reader.advance`, corrupt and missing objects, a failing store
write and two publishers racing for one version number. The only fake is `ScriptedStore`, a
LocalStore that fails, stalls or records chosen operations (the store boundary).
"""

from __future__ import annotations

import collections.abc
import concurrent.futures as cf
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from weightsync.errors import (
    FormatError,
    IntegrityError,
    PublishError,
    StoreError,
    VersionConflict,
    VersionNotFound,
)
from weightsync.format.layout import chunks_prefix, manifest_key, packs_prefix
from weightsync.format.manifest import CODEC_SAME, KIND_DELTA, KIND_FULL
from weightsync.publisher import Publisher, PublisherConfig, PublishResult
from weightsync.reader import Reader
from weightsync.stores import LocalStore
from weightsync.versions import list_versions, read_manifest, resolve_chain

MODEL = "org/tiny-model"
SMALL_CHUNKS = 16 * 1024  # several chunks per matrix, so unchanged chunks show up as "same"
WAIT_S = 60  # upper bound on any wait in these tests; never reached when things work


class ScriptedStore(LocalStore):
    """Stands in for a store that fails, stalls or records chosen operations (over a real
    LocalStore directory, so everything it lets through is really written)."""

    def __init__(self, root, **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.fail_chunk_puts = 0  # the next N chunk-object or pack puts raise StoreError
        self.failed_keys: list[str] = []
        self.chunk_puts_open = threading.Event()  # chunk-object and pack puts wait until this is set
        self.chunk_puts_open.set()
        self.held_put_new: dict[str, threading.Event] = {}  # key -> put_new of it waits for the event
        self._entered: dict[str, threading.Event] = {}
        self.committed: list[str] = []  # keys in the order their put_new completed
        self.after_put_new = None  # called with the key after a put_new completes
        self.gets: list[str] = []
        self._mutex = threading.Lock()

    def put(self, key, data) -> None:
        if "/chunks/" in key or "/packs/" in key:
            with self._mutex:
                fail = self.fail_chunk_puts > 0
                if fail:
                    self.fail_chunk_puts -= 1
                    self.failed_keys.append(key)
            if fail:
                raise StoreError(f"injected write failure for {key}")
            assert self.chunk_puts_open.wait(WAIT_S)
        super().put(key, data)

    def entered_put_new(self, key: str) -> threading.Event:
        """Set once a put_new of `key` has started."""
        with self._mutex:
            return self._entered.setdefault(key, threading.Event())

    def put_new(self, key, data) -> None:
        self.entered_put_new(key).set()
        held = self.held_put_new.get(key)
        if held is not None:
            held.wait(WAIT_S)
        super().put_new(key, data)
        with self._mutex:
            self.committed.append(key)
        if self.after_put_new is not None:
            self.after_put_new(key)

    def get(self, key) -> bytes:
        with self._mutex:
            self.gets.append(key)
        return super().get(key)

    def get_range(self, key, start, length) -> bytes:
        with self._mutex:
            self.gets.append(key)
        return super().get_range(key, start, length)


def _stored_objects(store) -> list:
    """Every chunk object and pack of MODEL in `store`."""
    return [*store.list(chunks_prefix(MODEL)), *store.list(packs_prefix(MODEL))]


def _config(**overrides) -> PublisherConfig:
    return PublisherConfig(**{"chunk_bytes": SMALL_CHUNKS, "workers": 2, **overrides})


def _reader(store) -> Reader:
    return Reader(store, model=MODEL, workers=2)


def _assert_versions_read_back(store, expected: dict[int, dict], assert_bit_equal) -> None:
    """Every version in `expected` reads back (fresh, from its base) bit-identical."""
    reader = _reader(store)
    for version, want in expected.items():
        state = reader.read(version)
        assert state.manifest.version == version
        assert_bit_equal(state.state_dict(), want)


def _publish_series(publisher, sd, count, perturb, published_view, *, fraction=0.05, seed=100, cast=torch.bfloat16):
    """Publishes `count` successive versions (perturbing between them); returns
    {version: published weights}, [results] and the last state dict."""
    expected, results = {}, []
    for i in range(count):
        if i:
            sd = perturb(sd, fraction, seed + i)
        result = publisher.publish(sd, step=10 * i).result(timeout=WAIT_S)
        expected[result.version] = published_view(sd, cast)
        results.append(result)
    return expected, results, sd


def _objects_needed(store, version: int) -> set[str]:
    return set().union(*(m.objects() for m in resolve_chain(store, MODEL, version)))


def _object_path(store: LocalStore, relkey: str):
    return store.root / "models" / MODEL / relkey


# ------------------------------------------------------------------------------ basics


def test_successive_versions_read_back_exactly(tmp_store, make_state_dict, perturb, published_view, assert_bit_equal):
    with Publisher(tmp_store, model=MODEL, config=_config()) as publisher:
        expected, results, _ = _publish_series(publisher, make_state_dict(0), 6, perturb, published_view)

    assert list(expected) == [1, 2, 3, 4, 5, 6] == list_versions(tmp_store, MODEL)
    _assert_versions_read_back(tmp_store, expected, assert_bit_equal)
    for want in expected.values():  # floats were published as bf16, everything else as handed in
        assert want["embed.weight"].dtype == torch.bfloat16 and want["position_ids"].dtype == torch.int64

    full = results[0]
    assert isinstance(full, PublishResult)
    assert (full.manifest.kind, full.manifest.parent, full.manifest.base, full.manifest.step) == (KIND_FULL, None, 1, 0)
    assert full.changed_elements == full.total_elements
    for i, result in enumerate(results[1:], start=1):
        manifest = read_manifest(tmp_store, MODEL, result.version)
        assert manifest == result.manifest
        assert (manifest.kind, manifest.parent, manifest.base, manifest.step) == (KIND_DELTA, i, 1, 10 * i)
        assert 0 < result.changed_elements < 0.05 * result.total_elements
        assert result.raw_bytes == full.raw_bytes
        assert result.stored_bytes * 10 < full.stored_bytes, "a sparse delta must be far smaller than a full version"
        # Tensors nobody changed are all "same" chunks: no object, nothing stored.
        (ids,) = [t for t in manifest.tensors if t.name == "position_ids"]
        assert ids.chunks and all(c.codec == CODEC_SAME and c.key is None and c.size == 0 for c in ids.chunks)
        (empty,) = [t for t in manifest.tensors if t.name == "empty.bias"]
        assert empty.shape == (0, 16) and empty.chunks == ()


@pytest.mark.filterwarnings("ignore::FutureWarning")  # gc.get_objects touches torch's deprecated aliases
@pytest.mark.parametrize("device_diff", [False, True])
def test_a_publisher_keeps_no_finished_versions(tmp_store, make_state_dict, perturb, device_diff):
    """Each version's job links to the one before (commits wait for it); a finished job must let
    go of it, or every version since the publisher started stays in memory: its manifest, its
    snapshot dict and, with device_diff, its host copies of the changes."""
    import gc

    from weightsync.publisher import _Job

    config = _config(device_diff=device_diff)
    with Publisher(tmp_store, model=MODEL, config=config) as publisher:
        state = make_state_dict(0)
        for step in range(8):
            publisher.publish(state, step=step).result(timeout=WAIT_S)
            state = perturb(state, 0.02, step + 1)
        gc.collect()
        live = [o for o in gc.get_objects() if isinstance(o, _Job)]
        assert len(live) <= 2, f"{len(live)} jobs alive after 8 versions"
        assert not any(job.changes for job in live)
    assert list_versions(tmp_store, MODEL) == list(range(1, 9))


def test_unchanged_chunks_store_no_objects(tmp_store, make_state_dict, published_view, assert_bit_equal):
    sd = make_state_dict(1)
    with Publisher(tmp_store, model=MODEL, config=_config()) as publisher:
        publisher.publish(sd).result(timeout=WAIT_S)
        objects_before = _stored_objects(tmp_store)
        changed = dict(sd)
        changed["layers.0.mlp.up.weight"] = sd["layers.0.mlp.up.weight"].clone()
        changed["layers.0.mlp.up.weight"][10, :] += 1.0  # 256 elements, all inside the first chunk
        result = publisher.publish(changed).result(timeout=WAIT_S)

    manifest = result.manifest
    assert manifest.kind == KIND_DELTA
    stored = [(t.name, c.start) for t in manifest.tensors for c in t.chunks if c.codec != CODEC_SAME]
    assert stored == [("layers.0.mlp.up.weight", 0)]
    assert result.changed_elements == 256
    assert len(manifest.objects()) == 1
    assert len(_stored_objects(tmp_store)) == len(objects_before) + 1  # one pack, holding the one chunk
    _assert_versions_read_back(tmp_store, {1: published_view(sd), 2: published_view(changed)}, assert_bit_equal)


def test_publishing_identical_weights_stores_nothing(tmp_store, make_state_dict, published_view, assert_bit_equal):
    sd = make_state_dict(2)
    with Publisher(tmp_store, model=MODEL, config=_config()) as publisher:
        first = publisher.publish(sd).result(timeout=WAIT_S)
        again = publisher.publish(sd).result(timeout=WAIT_S)
    assert again.manifest.kind == KIND_DELTA and again.stored_bytes == 0 and again.changed_elements == 0
    assert again.manifest.digest == first.manifest.digest
    _assert_versions_read_back(tmp_store, {1: published_view(sd), 2: published_view(sd)}, assert_bit_equal)


def _special_values_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # NaNs with payloads, +-inf, -0.0, subnormals, as bit patterns
    f32_bits = [0x7FC00001, 0xFFC12345, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x807FFFFF]
    f32_specials = torch.from_numpy(np.array(f32_bits, dtype=np.uint32).view(np.float32))
    f16_bits = [0x7E01, 0xFE23, 0x7C00, 0x8000, 0x0001, 0x83FF]
    f16_specials = torch.from_numpy(np.array(f16_bits, dtype=np.uint16).view(np.float16))
    return {
        "w.f32": torch.randn(300, 70, generator=g),
        "w.f16": torch.randn(120, 90, generator=g).half(),
        "w.bf16": torch.randn(50, 50, generator=g).bfloat16(),
        "w.f64": torch.randn(1000, generator=g).double(),
        "specials.f32": f32_specials,
        "specials.f16": f16_specials,
        "scalar.f16": torch.tensor(0.5, dtype=torch.float16),
        "empty.f32": torch.empty(3, 0),
        "mask": torch.rand(40, generator=g) > 0.5,
        "counts": torch.arange(100, dtype=torch.int32),
    }


def test_cast_floats_to_none_keeps_every_dtype_bit_exact(tmp_store, perturb, published_view, assert_bit_equal):
    sd = _special_values_state_dict()
    with Publisher(tmp_store, model=MODEL, config=_config(cast_floats_to=None, chunk_bytes=4096)) as publisher:
        expected, results, _ = _publish_series(publisher, sd, 3, perturb, published_view, fraction=0.1, cast=None)
    assert [r.manifest.kind for r in results] == [KIND_FULL, KIND_DELTA, KIND_DELTA]
    assert {t.name: t.dtype for t in results[0].manifest.tensors}["w.f16"] == "float16"
    for want in expected.values():
        assert {n: t.dtype for n, t in want.items()} == {n: t.dtype for n, t in sd.items()}
    _assert_versions_read_back(tmp_store, expected, assert_bit_equal)


def test_non_contiguous_and_parameter_tensors(tmp_store, make_state_dict, published_view, assert_bit_equal):
    sd = make_state_dict(3)
    sd["transposed"] = sd["layers.0.attn.qkv.weight"].t()
    sd["sliced"] = sd["layers.0.mlp.up.weight"][::3, 5:200]
    sd["param"] = torch.nn.Parameter(torch.randn(33, 17))
    with Publisher(tmp_store, model=MODEL, config=_config()) as publisher:
        publisher.publish(sd).result(timeout=WAIT_S)
    expected = {k: v.detach() for k, v in published_view(sd).items()}
    _assert_versions_read_back(tmp_store, {1: expected}, assert_bit_equal)


# ------------------------------------------------------------------------------ rebases


@pytest.mark.parametrize(
    "rebase_every, kinds",
    [(2, "FDDFDDF"), (0, "FFFF"), (1, "FDFDF")],
)
def test_rebase_every(tmp_store, make_state_dict, perturb, published_view, assert_bit_equal, rebase_every, kinds):
    config = _config(rebase_every=rebase_every, rebase_chain_ratio=1e9)
    with Publisher(tmp_store, model=MODEL, config=config) as publisher:
        expected, results, _ = _publish_series(publisher, make_state_dict(4), len(kinds), perturb, published_view)
    manifests = [r.manifest for r in results]
    assert "".join("F" if m.kind == KIND_FULL else "D" for m in manifests) == kinds
    base = None
    for m in manifests:
        base = m.version if m.kind == KIND_FULL else base
        assert m.base == base
        if m.kind == KIND_DELTA:
            assert m.parent == m.version - 1
    _assert_versions_read_back(tmp_store, expected, assert_bit_equal)


def _reshape(sd):
    sd["layers.0.mlp.up.weight"] = sd["layers.0.mlp.up.weight"].reshape(256, 768).clone()


def _resize(sd):
    sd["embed.weight"] = torch.cat([sd["embed.weight"], torch.ones(1, 256)])


def _int_dtype(sd):
    sd["position_ids"] = sd["position_ids"].to(torch.int32)


def _float_dtype(sd):  # visible only when floats are not cast to one dtype
    sd["layers.1.norm.weight"] = sd["layers.1.norm.weight"].half()


def _add(sd):
    sd["extra.weight"] = torch.full((10, 10), 0.25)


def _remove(sd):
    del sd["layers.1.norm.weight"]


def _rename(sd):
    sd["renamed.weight"] = sd.pop("embed.weight")


@pytest.mark.parametrize(
    "change, cast",
    [
        (_reshape, "bfloat16"),
        (_resize, "bfloat16"),
        (_int_dtype, "bfloat16"),
        (_float_dtype, None),
        (_add, "bfloat16"),
        (_remove, "bfloat16"),
        (_rename, "bfloat16"),
    ],
    ids=lambda p: getattr(p, "__name__", str(p)),
)
def test_layout_change_forces_full_version(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal, change, cast
):
    torch_cast = getattr(torch, cast) if cast else None
    sd = make_state_dict(5)
    expected = {}
    with Publisher(tmp_store, model=MODEL, config=_config(cast_floats_to=cast)) as publisher:
        publisher.publish(sd).result(timeout=WAIT_S)
        expected[1] = published_view(sd, torch_cast)
        sd = perturb(sd, 0.05, 1)
        assert publisher.publish(sd).result(timeout=WAIT_S).manifest.kind == KIND_DELTA
        expected[2] = published_view(sd, torch_cast)
        changed = perturb(sd, 0.05, 2)
        change(changed)
        third = publisher.publish(changed).result(timeout=WAIT_S).manifest
        expected[3] = published_view(changed, torch_cast)
        after = perturb(changed, 0.05, 3)
        fourth = publisher.publish(after).result(timeout=WAIT_S).manifest
        expected[4] = published_view(after, torch_cast)

    assert (third.kind, third.base) == (KIND_FULL, 3)
    assert (fourth.kind, fourth.parent, fourth.base) == (KIND_DELTA, 3, 3)
    _assert_versions_read_back(tmp_store, expected, assert_bit_equal)
    state = _reader(tmp_store).read(2)  # an agent on v2 crosses the layout change
    _reader(tmp_store).advance(state, 4)
    assert_bit_equal(state.state_dict(), expected[4])


# ------------------------------------------------------------------------ in-flight bound


def test_many_versions_in_flight_commit_in_order(tmp_path, make_state_dict, perturb, published_view, assert_bit_equal):
    store = ScriptedStore(tmp_path / "store")
    sd = make_state_dict(6)
    futures, expected = [], {}
    with Publisher(store, model=MODEL, config=_config(max_in_flight=2)) as publisher:
        for i in range(12):
            sd = perturb(sd, 0.05, 600 + i)
            futures.append(publisher.publish(sd, step=i))
            expected[i + 1] = published_view(sd)
        results = [f.result(timeout=WAIT_S) for f in futures]

    assert all(isinstance(r, PublishResult) for r in results)
    assert [r.version for r in results] == list(range(1, 13))
    assert [r.manifest.step for r in results] == list(range(12))
    assert store.committed == [manifest_key(MODEL, v) for v in range(1, 13)], "commits must happen in version order"
    assert list_versions(store, MODEL) == list(range(1, 13))
    _assert_versions_read_back(store, expected, assert_bit_equal)


def test_publish_blocks_while_max_in_flight_versions_run(
    tmp_path, make_state_dict, perturb, published_view, assert_bit_equal
):
    store = ScriptedStore(tmp_path / "store")
    store.chunk_puts_open.clear()  # uploads stall until the test opens them
    sd1 = make_state_dict(7)
    sd2, sd3 = perturb(sd1, 0.05, 1), perturb(sd1, 0.05, 2)
    with Publisher(store, model=MODEL, config=_config(max_in_flight=2)) as publisher:
        f1 = publisher.publish(sd1)
        f2 = publisher.publish(sd2)
        third: list[cf.Future] = []
        blocked = threading.Thread(target=lambda: third.append(publisher.publish(sd3)))
        blocked.start()
        blocked.join(timeout=0.5)
        still_blocked, done_early = blocked.is_alive(), f1.done() or f2.done()
        store.chunk_puts_open.set()
        blocked.join(timeout=WAIT_S)
        assert not done_early
        assert still_blocked, "a third publish() must wait while max_in_flight=2 versions are in flight"
        results = [f.result(timeout=WAIT_S) for f in (f1, f2, third[0])]
    assert [r.version for r in results] == [1, 2, 3]
    expected = {1: published_view(sd1), 2: published_view(sd2), 3: published_view(sd3)}
    _assert_versions_read_back(store, expected, assert_bit_equal)


# --------------------------------------------------------------------- parent_from_store


@pytest.mark.slow
def test_second_publisher_continues_from_store(tmp_store, make_state_dict, perturb, published_view, assert_bit_equal):
    config = _config(rebase_every=2, rebase_chain_ratio=1e9)
    with Publisher(tmp_store, model=MODEL, config=config) as first:
        expected, _, sd = _publish_series(first, make_state_dict(8), 2, perturb, published_view)

    with Publisher(tmp_store, model=MODEL, config=config) as second:
        sd3 = perturb(sd, 0.05, 3)
        third = second.publish(sd3, step=30).result(timeout=WAIT_S).manifest
        sd4 = perturb(sd3, 0.05, 4)
        fourth = second.publish(sd4).result(timeout=WAIT_S).manifest
    expected.update({3: published_view(sd3), 4: published_view(sd4)})

    assert (third.version, third.kind, third.parent, third.base, third.step) == (3, KIND_DELTA, 2, 1, 30)
    assert third.stored_bytes * 10 < read_manifest(tmp_store, MODEL, 1).stored_bytes
    assert (fourth.version, fourth.kind) == (4, KIND_FULL), "the chain read from the store already held 2 deltas"
    _assert_versions_read_back(tmp_store, expected, assert_bit_equal)


def test_parent_from_store_off_continues_numbering_with_a_full_version(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal
):
    with Publisher(tmp_store, model=MODEL, config=_config()) as first:
        expected, _, sd = _publish_series(first, make_state_dict(9), 2, perturb, published_view)
    sd3 = perturb(sd, 0.05, 3)
    with Publisher(tmp_store, model=MODEL, config=_config(parent_from_store=False)) as second:
        third = second.publish(sd3).result(timeout=WAIT_S).manifest
    assert (third.version, third.kind, third.base) == (3, KIND_FULL, 3)
    expected[3] = published_view(sd3)
    _assert_versions_read_back(tmp_store, expected, assert_bit_equal)


# ------------------------------------------------------------------------------ advance


def test_advance_applies_only_the_newer_deltas(tmp_path, make_state_dict, perturb, published_view, assert_bit_equal):
    store = ScriptedStore(tmp_path / "store")
    with Publisher(store, model=MODEL, config=_config()) as publisher:
        expected, _, _ = _publish_series(publisher, make_state_dict(10), 5, perturb, published_view)
    reader = _reader(store)
    state = reader.read(2)
    store.gets.clear()

    assert reader.advance(state, 5) is state
    prefix = f"models/{MODEL}/"
    fetched = {k.removeprefix(prefix) for k in store.gets if "/chunks/" in k or "/packs/" in k}
    assert state.manifest.version == 5
    assert_bit_equal(state.state_dict(), expected[5])
    assert_bit_equal(reader.read(5).state_dict(), state.state_dict())
    newer = set().union(*(read_manifest(store, MODEL, v).objects() for v in (3, 4, 5)))
    assert fetched == newer
    assert not fetched & read_manifest(store, MODEL, 1).objects()

    store.gets.clear()
    reader.advance(state)  # already at the latest: nothing to fetch
    assert not [k for k in store.gets if "/chunks/" in k or "/packs/" in k]


def test_advance_across_a_rebase_and_backwards(tmp_store, make_state_dict, perturb, published_view, assert_bit_equal):
    config = _config(rebase_every=2, rebase_chain_ratio=1e9)
    with Publisher(tmp_store, model=MODEL, config=config) as publisher:
        expected, results, _ = _publish_series(publisher, make_state_dict(11), 6, perturb, published_view)
    assert [r.manifest.base for r in results] == [1, 1, 1, 4, 4, 4]
    reader = _reader(tmp_store)
    state = reader.read(2)
    reader.advance(state, 5)
    assert state.manifest.version == 5
    assert_bit_equal(state.state_dict(), expected[5])
    reader.advance(state)
    assert_bit_equal(state.state_dict(), expected[6])
    reader.advance(state, 3)  # going back means reading from v3's base
    assert_bit_equal(state.state_dict(), expected[3])
    with pytest.raises(VersionNotFound):
        reader.read(7)


# ---------------------------------------------------------------------------- corruption


@pytest.fixture
def four_versions(tmp_store, make_state_dict, perturb, published_view):
    """v1 full, v2..v4 deltas; returns (store, {version: published weights})."""
    with Publisher(tmp_store, model=MODEL, config=_config()) as publisher:
        expected, _, _ = _publish_series(publisher, make_state_dict(12), 4, perturb, published_view)
    return tmp_store, expected


def _object_only_in(store, version: int, versions) -> str:
    mine = read_manifest(store, MODEL, version).objects()
    others = set().union(*(read_manifest(store, MODEL, v).objects() for v in versions if v != version))
    return sorted(mine - others)[0]


def test_flipped_byte_in_a_chunk_object(four_versions, assert_bit_equal):
    store, expected = four_versions
    key = _object_only_in(store, 3, expected)
    path = _object_path(store, key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))

    reader = _reader(store)
    for version in (3, 4):  # v4 is a delta on v3, so it needs the object too
        assert key in _objects_needed(store, version)
        with pytest.raises((IntegrityError, FormatError)):
            reader.read(version)
    with pytest.raises((IntegrityError, FormatError)):
        reader.verify(3)
    for version in (1, 2):
        assert key not in _objects_needed(store, version)
        assert_bit_equal(reader.read(version).state_dict(), expected[version])


def test_failed_advance_invalidates_the_state(four_versions, assert_bit_equal):
    store, expected = four_versions
    key = _object_only_in(store, 3, expected)
    _object_path(store, key).write_bytes(b"WSCK" + bytes(100))
    reader = _reader(store)
    state = reader.read(2)
    with pytest.raises((IntegrityError, FormatError)):
        reader.advance(state, 4)
    assert state.manifest is None
    with pytest.raises(IntegrityError):
        state.state_dict()
    reader.advance(state, 2)  # an invalid state is read again from its base
    assert_bit_equal(state.state_dict(), expected[2])


def test_missing_chunk_object_names_its_key(four_versions, assert_bit_equal):
    store, expected = four_versions
    key = _object_only_in(store, 2, expected)
    store.delete(f"models/{MODEL}/{key}")
    reader = _reader(store)
    for version in (2, 3, 4):
        with pytest.raises(IntegrityError) as info:
            reader.read(version)
        assert key in str(info.value)
    assert_bit_equal(reader.read(1).state_dict(), expected[1])


def test_missing_base_object_fails_the_whole_chain_only(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal
):
    config = _config(rebase_every=1, rebase_chain_ratio=1e9)
    with Publisher(tmp_store, model=MODEL, config=config) as publisher:
        expected, _, _ = _publish_series(publisher, make_state_dict(13), 4, perturb, published_view)  # F D F D
    key = _object_only_in(tmp_store, 1, expected)
    _object_path(tmp_store, key).unlink()
    reader = _reader(tmp_store)
    for version in (1, 2):
        with pytest.raises(IntegrityError):
            reader.read(version)
    for version in (3, 4):
        assert_bit_equal(reader.read(version).state_dict(), expected[version])


# ------------------------------------------------------------------------ failing writes


def test_failed_chunk_write_fails_the_version_and_the_next_is_full(
    tmp_path, make_state_dict, perturb, published_view, assert_bit_equal
):
    store = ScriptedStore(tmp_path / "store")
    sd1 = make_state_dict(14)
    sd2, sd3 = perturb(sd1, 0.05, 2), perturb(sd1, 0.05, 3)
    with Publisher(store, model=MODEL, config=_config()) as publisher:
        publisher.publish(sd1).result(timeout=WAIT_S)
        store.fail_chunk_puts = 1
        failed = publisher.publish(sd2)
        with pytest.raises(PublishError) as info:
            failed.result(timeout=WAIT_S)
        assert store.failed_keys and store.failed_keys[0] in str(info.value)
        assert not store.exists(manifest_key(MODEL, 2))
        assert list_versions(store, MODEL) == [1]
        result = publisher.publish(sd3).result(timeout=WAIT_S)

    assert len(store.failed_keys) == 1
    assert (result.version, result.manifest.kind, result.manifest.base) == (3, KIND_FULL, 3)
    assert list_versions(store, MODEL) == [1, 3]
    _assert_versions_read_back(store, {1: published_view(sd1), 3: published_view(sd3)}, assert_bit_equal)


@pytest.mark.slow
def test_commits_stay_in_version_order_when_a_version_fails_early(
    tmp_path, make_state_dict, perturb, published_view, assert_bit_equal
):
    """v1 is slow to commit, v2 fails while encoding, v3 (a full version) must still commit
    after v1: docs/format.md says versions are strictly increasing in commit order."""
    store = ScriptedStore(tmp_path / "store")
    v1_key, v3_key = manifest_key(MODEL, 1), manifest_key(MODEL, 3)
    v1_gate = threading.Event()
    store.held_put_new[v1_key] = v1_gate  # released when v3 commits, or after a while if it never can
    store.after_put_new = lambda key: v1_gate.set() if key == v3_key else None
    sd1 = make_state_dict(15)
    sd2, sd3 = perturb(sd1, 0.05, 2), perturb(sd1, 0.05, 3)
    with Publisher(store, model=MODEL, config=_config(max_in_flight=3)) as publisher:
        f1 = publisher.publish(sd1)
        assert store.entered_put_new(v1_key).wait(WAIT_S)
        store.fail_chunk_puts = 1
        f2 = publisher.publish(sd2)
        assert isinstance(f2.exception(timeout=WAIT_S), PublishError)
        f3 = publisher.publish(sd3)
        timer = threading.Timer(3.0, v1_gate.set)  # lets a correct publisher (v3 waiting on v1) finish
        timer.start()
        try:
            results = [f1.result(timeout=WAIT_S), f3.result(timeout=WAIT_S)]
        finally:
            timer.cancel()
    assert [r.version for r in results] == [1, 3]
    assert store.committed == [v1_key, v3_key], "v3 was committed before v1"
    _assert_versions_read_back(store, {1: published_view(sd1), 3: published_view(sd3)}, assert_bit_equal)


# --------------------------------------------------------------------- racing publishers


def test_racing_publishers_one_gets_version_conflict(
    tmp_path, make_state_dict, perturb, published_view, assert_bit_equal
):
    root = tmp_path / "store"
    slow_store, fast_store = ScriptedStore(root), LocalStore(root)
    key = manifest_key(MODEL, 1)
    gate = threading.Event()
    slow_store.held_put_new[key] = gate
    sd_slow, sd_fast = make_state_dict(16), make_state_dict(17)
    with (
        Publisher(slow_store, model=MODEL, config=_config()) as slow,
        Publisher(fast_store, model=MODEL, config=_config()) as fast,
    ):
        slow_future = slow.publish(sd_slow)  # numbered v1, then stalls at its commit
        assert slow_store.entered_put_new(key).wait(WAIT_S)
        won = fast.publish(sd_fast).result(timeout=WAIT_S)  # also v1: the store had no versions
        gate.set()
        with pytest.raises(VersionConflict):
            slow_future.result(timeout=WAIT_S)
        sd_again = perturb(sd_slow, 0.05, 1)
        again = slow.publish(sd_again).result(timeout=WAIT_S)  # the loser renumbers from the store

    assert won.version == 1
    assert [i.key for i in fast_store.list(f"models/{MODEL}/versions/")] == [key, manifest_key(MODEL, 2)]
    assert read_manifest(fast_store, MODEL, 1) == won.manifest
    assert (again.version, again.manifest.kind) == (2, KIND_FULL)
    _assert_versions_read_back(fast_store, {1: published_view(sd_fast), 2: published_view(sd_again)}, assert_bit_equal)


def test_publisher_metrics_reach_prometheus(tmp_store, make_state_dict, perturb):
    from weightsync.metrics import PrometheusMetrics

    metrics = PrometheusMetrics(model="m")
    sd = make_state_dict(21)
    with Publisher(tmp_store, model="m", config=PublisherConfig(chunk_bytes=16 * 1024), metrics=metrics) as p:
        p.publish(sd).result()
        p.publish(perturb(sd, 0.02, 1)).result()
    text = metrics.exposition().decode()
    assert 'weightsync_publish_versions_total{kind="full",model="m"} 1.0' in text
    assert 'weightsync_publish_versions_total{kind="delta",model="m"} 1.0' in text
    assert 'weightsync_publish_version{model="m"} 2.0' in text
    assert "weightsync_publish_latency_s_count" in text and "weightsync_publish_ratio" in text


class _ObjectSeen:
    """A publish listener that records when the first encoded object appears."""

    def __init__(self) -> None:
        self.first = threading.Event()

    def on_object(self, version, object_xxh3, obj, placement) -> None:
        self.first.set()

    def on_commit(self, manifest, manifest_bytes, signature) -> None:
        pass

    def on_failure(self, version, error) -> None:
        pass


class _GatedStateDict(collections.abc.Mapping):
    """A state dict whose last tensor cannot be copied until `gate` is set (its first access is
    publish()'s layout check, its second the copy): what an overlap of copy and encode needs."""

    def __init__(self, tensors: dict, gate: threading.Event) -> None:
        self._tensors, self._gate, self._reads = tensors, gate, 0
        self._last = list(tensors)[-1]
        self.gate_was_open = None

    def __getitem__(self, name):
        if name == self._last:
            self._reads += 1
            if self._reads == 2:
                self.gate_was_open = self._gate.wait(WAIT_S)
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def test_encoding_starts_while_publish_is_still_copying(tmp_store, make_state_dict, published_view, assert_bit_equal):
    """Stages overlap: the first tensors' chunks are encoded (and handed to listeners) before
    publish() has copied the last tensor."""
    sd = make_state_dict(31)
    seen = _ObjectSeen()
    gated = _GatedStateDict(sd, seen.first)
    with Publisher(tmp_store, model=MODEL, config=_config(), listeners=[seen]) as publisher:
        result = publisher.publish(gated).result(timeout=WAIT_S)
    assert gated.gate_was_open, "no object was encoded before publish() copied the last tensor"
    _assert_versions_read_back(tmp_store, {result.version: published_view(sd)}, assert_bit_equal)


@pytest.mark.timeout(1800)
def test_the_first_publish_warms_up_the_delta_kernels_for_its_dtypes(tmp_path):
    # On a machine whose numba cache is empty, the first (full) version starts compiling what the
    # next version, a delta, needs. Observed in numba's on-disk cache. The warm-up thread asks for
    # low priority; here it is recorded, not granted: niced, the compile waits for idle CPU, which
    # a loaded machine running the rest of the suite beside it has little of (5 minutes at load 4).
    numba_cache = tmp_path / "numba"
    code = (
        "import threading, torch\n"
        "from weightsync.format.codecs import warmup\n"
        "from weightsync.publisher import Publisher, PublisherConfig\n"
        "from weightsync.stores import LocalStore\n"
        "lowered = []\n"
        "warmup.lower_this_thread_priority = lambda: lowered.append(threading.current_thread().name)\n"
        f"store = LocalStore({str(tmp_path / 'store')!r})\n"
        "with Publisher(store, model='m', config=PublisherConfig(cast_floats_to=None, workers=2)) as publisher:\n"
        "    state = {'w': torch.ones(64, dtype=torch.bfloat16), 'f': torch.ones(64, dtype=torch.float32)}\n"
        "    assert publisher.publish(state).result().manifest.kind == 'full'\n"
        "    assert publisher.warm_up.wait(timeout=1200)\n"
        "assert len(lowered) == 1 and lowered[0] != threading.main_thread().name, lowered\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=1500, env={**os.environ, "NUMBA_CACHE_DIR": str(numba_cache)}
    )
    cached = {p.name for p in numba_cache.rglob("*.nbi")}
    for kernel in ("changes._scan_kernel", "ctx._emit_kernel", "rans."):
        assert any(name.startswith(kernel) for name in cached), (kernel, sorted(cached))
    # one compiled variant per element width (bf16: 2 bytes, fp32: 4) in the scan's index
    scan_index = next(p for p in numba_cache.rglob("changes._scan_kernel*.nbi"))
    assert len(list(scan_index.parent.glob(scan_index.stem + ".*.nbc"))) >= 2


def test_a_one_shot_cli_publish_compiles_no_kernel_it_does_not_need(tmp_path):
    """`weightsync publish` of a full version on a machine whose numba cache is empty used to take
    over a minute to exit, waiting for the warm-up of kernels only deltas need: now nothing is
    compiled (the cache stays empty) and the library's publisher starts no warm-up when told not to."""
    numba_cache = tmp_path / "numba"
    save_file({"w": torch.ones(64, 32)}, str(tmp_path / "ckpt.safetensors"))
    subprocess.run(
        [sys.executable, "-m", "weightsync.app.cli", "publish", "--store", str(tmp_path / "store"), "--model", "m",
         str(tmp_path / "ckpt.safetensors")],
        check=True, timeout=600, env={**os.environ, "NUMBA_CACHE_DIR": str(numba_cache)}, capture_output=True,
    )  # fmt: skip
    assert not list(numba_cache.rglob("*.nbi")), sorted(p.name for p in numba_cache.rglob("*"))
    with Publisher(LocalStore(tmp_path / "s2"), model=MODEL, config=_config(warm_up_kernels=False)) as publisher:
        publisher.publish({"w": torch.ones(64, dtype=torch.bfloat16)}).result(timeout=WAIT_S)
        assert publisher.warm_up is None
