"""Packs (weightsync/format/pack.py, docs/format.md "Packs"): a delta's chunk objects in a few store
objects, read back with ranged reads and checked member by member; old unpacked stores and
mixed chains still read; damage to a pack or its index is a clear error; gc keeps packs a kept
version names and deletes the others."""

from __future__ import annotations

import os
import time

import pytest

from weightsync.errors import IntegrityError
from weightsync.format.layout import chunks_prefix, model_prefix, packs_prefix
from weightsync.format.manifest import FORMAT_PACKS, FORMAT_VERSION, KIND_DELTA, ChunkRef
from weightsync.format.pack import PackWriter, group_span, plan_reads
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.stores import LocalStore
from weightsync.stores.retention import collect_garbage
from weightsync.versions import read_manifest

MODEL = "pk/model"
WAIT_S = 60


class CountingStore(LocalStore):
    """A LocalStore that counts whole and ranged reads of chunk objects and packs."""

    def __init__(self, root, **kwargs) -> None:
        super().__init__(root, **kwargs)
        self.reads: list[tuple[str, int | None]] = []

    def get(self, key):
        if "/chunks/" in key or "/packs/" in key:
            self.reads.append((key, None))
        return super().get(key)

    def get_range(self, key, start, length):
        self.reads.append((key, length))
        return super().get_range(key, start, length)


def _publish(store, sds, **config) -> list:
    settings = {"chunk_bytes": 16 * 1024, "workers": 2, **config}
    with Publisher(store, model=MODEL, config=PublisherConfig(**settings)) as publisher:
        return [publisher.publish(sd).result(timeout=WAIT_S) for sd in sds]


def _series(make_state_dict, perturb, n: int) -> list[dict]:
    sds = [make_state_dict(3)]
    for i in range(1, n):
        sds.append(perturb(sds[-1], 0.02, seed=i))
    return sds


def _packed_refs(manifest) -> list[ChunkRef]:
    return [c for t in manifest.tensors for c in t.chunks if c.packed]


def test_deltas_are_packed_full_versions_are_not(tmp_store, make_state_dict, perturb, published_view, assert_bit_equal):
    sds = _series(make_state_dict, perturb, 3)
    results = _publish(tmp_store, sds)
    full, deltas = results[0].manifest, [r.manifest for r in results[1:]]
    assert full.format == FORMAT_VERSION and not full.has_packs  # format-1 readers still read it
    for manifest in deltas:
        assert manifest.kind == KIND_DELTA and manifest.format == FORMAT_PACKS
        stored = [c for t in manifest.tensors for c in t.chunks if c.object]
        assert stored and all(c.packed for c in stored)
        assert len(manifest.objects()) == 1  # a small delta is one pack: one store write
    assert len(list(tmp_store.list(packs_prefix(MODEL)))) == 2
    reader = Reader(tmp_store, model=MODEL)
    for version, sd in enumerate(sds, start=1):
        assert_bit_equal(reader.read(version).state_dict(), published_view(sd))


def test_pack_size_bounds_packs_and_reads_are_coalesced(
    tmp_path, make_state_dict, perturb, published_view, assert_bit_equal
):
    sds = _series(make_state_dict, perturb, 2)
    # The bound from the members themselves (their size depends on the codec that wins): about a
    # third of the delta per pack, so there are several packs and several members in some pack.
    (_, unpacked) = _publish(LocalStore(tmp_path / "unpacked"), sds, pack_bytes=0)
    sizes = [c.size for t in unpacked.manifest.tensors for c in t.chunks if c.object]
    assert len(sizes) >= 6 and max(sizes) < sum(sizes) // 3
    pack_bytes = sum(sizes) // 3
    store = CountingStore(tmp_path / "store")
    (_, delta) = _publish(store, sds, pack_bytes=pack_bytes)
    members = _packed_refs(delta.manifest)
    packs = {c.key for c in members}
    assert len(members) > len(packs) > 1
    for key in packs:  # a pack is sealed once it reaches pack_bytes: at most one member past it
        in_pack = sorted((c for c in members if c.key == key), key=lambda c: c.offset)
        assert sum(c.size for c in in_pack[:-1]) < pack_bytes
        size = os.path.getsize(store.root / model_prefix(MODEL) / key)
        assert size == in_pack[-1].offset + in_pack[-1].size  # members back to back, nothing else
    state = Reader(store, model=MODEL).read(1)
    store.reads.clear()
    Reader(store, model=MODEL).advance(state, 2)
    assert_bit_equal(state.state_dict(), published_view(sds[1]))
    # One ranged read per pack (each is far below the coalescing limit), not one per chunk.
    assert sorted(key for key, _ in store.reads) == sorted(model_prefix(MODEL) + k for k in packs)


def test_unpacked_stores_and_mixed_chains_still_read(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal
):
    sds = _series(make_state_dict, perturb, 4)
    old = _publish(tmp_store, sds[:2], pack_bytes=0)  # as an older publisher wrote them
    assert all(not r.manifest.has_packs and r.manifest.format == FORMAT_VERSION for r in old)
    assert not list(tmp_store.list(packs_prefix(MODEL)))
    new = _publish(tmp_store, sds[2:])  # continues the chain from the store, in packs
    assert [r.manifest.kind for r in new] == [KIND_DELTA, KIND_DELTA] and all(r.manifest.has_packs for r in new)
    reader = Reader(tmp_store, model=MODEL)
    for version, sd in enumerate(sds, start=1):
        assert_bit_equal(reader.read(version).state_dict(), published_view(sd))


def _one_delta(store, make_state_dict, perturb):
    sds = _series(make_state_dict, perturb, 2)
    results = _publish(store, sds)
    refs = _packed_refs(results[1].manifest)
    return refs, model_prefix(MODEL) + refs[0].key


def test_corrupt_pack_member_is_an_integrity_error(tmp_store, make_state_dict, perturb):
    refs, key = _one_delta(tmp_store, make_state_dict, perturb)
    data = bytearray(tmp_store.get(key))
    data[refs[0].offset + 70] ^= 0x10  # in the first member's payload
    tmp_store.put(key, bytes(data))
    with pytest.raises(IntegrityError, match=f"chunk object {refs[0].object} at bytes .* of pack .* is corrupt"):
        Reader(tmp_store, model=MODEL).read(2)


def test_missing_pack_is_an_integrity_error(tmp_store, make_state_dict, perturb):
    _, key = _one_delta(tmp_store, make_state_dict, perturb)
    tmp_store.delete(key)
    with pytest.raises(IntegrityError, match="pack .* named by a manifest is missing"):
        Reader(tmp_store, model=MODEL).read(2)


def test_truncated_pack_is_an_integrity_error(tmp_store, make_state_dict, perturb):
    refs, key = _one_delta(tmp_store, make_state_dict, perturb)
    end = max(r.offset + r.size for r in refs)
    tmp_store.put(key, tmp_store.get(key)[: end - 10])
    with pytest.raises(IntegrityError, match="shorter than the manifest's index says"):
        Reader(tmp_store, model=MODEL).read(2)


def test_pack_holding_other_bytes_than_its_index_says_is_an_integrity_error(tmp_store, make_state_dict, perturb):
    """A bad index (offsets that point at the wrong bytes) cannot pass: every member is checked
    against its own hash."""
    refs, key = _one_delta(tmp_store, make_state_dict, perturb)
    data = tmp_store.get(key)
    tmp_store.put(key, data[refs[-1].offset :] + data[: refs[-1].offset])  # members moved around
    with pytest.raises(IntegrityError, match="is corrupt"):
        Reader(tmp_store, model=MODEL).read(2)


def test_gc_keeps_packs_of_kept_versions_and_deletes_the_rest(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal
):
    sds = _series(make_state_dict, perturb, 6)
    results = _publish(tmp_store, sds, rebase_every=2, rebase_chain_ratio=1e9)  # bases 1 and 4
    assert [r.manifest.kind for r in results] == ["full", "delta", "delta"] * 2
    in_flight = model_prefix(MODEL) + "packs/ab/" + "ab" * 16  # a pack whose manifest is not committed yet
    tmp_store.put(in_flight, b"x" * 100)
    old = time.time() - 7200
    for info in [*tmp_store.list(chunks_prefix(MODEL)), *tmp_store.list(packs_prefix(MODEL))]:
        if info.key != in_flight:
            os.utime(tmp_store.root / info.key, (old, old))
    plan = collect_garbage(tmp_store, MODEL, keep=1, grace_s=3600)
    assert plan.keep_versions == (4, 5, 6) and plan.young_unreferenced == 1
    packs = {info.key for info in tmp_store.list(packs_prefix(MODEL))}
    kept = {model_prefix(MODEL) + k for v in (5, 6) for k in read_manifest(tmp_store, MODEL, v).objects()}
    assert packs == kept | {in_flight}
    reader = Reader(tmp_store, model=MODEL)
    for version in (4, 5, 6):
        assert_bit_equal(reader.read(version).state_dict(), published_view(sds[version - 1]))


@pytest.mark.s3
def test_packed_deltas_round_trip_on_s3(s3_store, make_state_dict, perturb, published_view, assert_bit_equal):
    sds = _series(make_state_dict, perturb, 3)
    results = _publish(s3_store, sds, pack_bytes=16 * 1024)
    assert all(r.manifest.has_packs for r in results[1:])
    reader = Reader(s3_store, model=MODEL)
    state = reader.read(1)
    for version, sd in enumerate(sds, start=1):
        reader.advance(state, version)
        assert_bit_equal(state.state_dict(), published_view(sd))


# ----------------------------------------------------------------------- units: packing, plans


def _ref(offset: int | None, size: int, key: str = "packs/aa/" + "aa" * 16, obj: str = "b" * 32) -> ChunkRef:
    return ChunkRef(start=0, stop=1, codec="xor", raw="a" * 32, object=obj, key=key, size=size, offset=offset)


def test_plan_reads_groups_nearby_members_of_one_pack():
    a, b, c = _ref(0, 100), _ref(100, 50), _ref(150 + 2 * 1024 * 1024, 10)  # c is past the gap limit
    other = _ref(0, 10, key="packs/bb/" + "bb" * 16)
    loose = ChunkRef(start=0, stop=1, codec="xor", raw="a" * 32, object="c" * 32, key="chunks/cc/" + "c" * 32, size=99)
    groups = plan_reads([c, loose, b, other, a])
    assert sorted(groups, key=lambda g: (g[0].key, g[0].offset)) == sorted(
        [[a, b], [c], [other], [loose]], key=lambda g: (g[0].key, g[0].offset)
    )
    assert group_span([a, b]) == (0, 150)
    big = [_ref(i * 1000, 1000) for i in range(10)]
    assert [len(g) for g in plan_reads(big, max_bytes=3000)] == [3, 3, 3, 1]


def test_pack_writer_seals_full_packs_as_they_fill():
    uploads = []
    writer = PackWriter(100, lambda key, data: uploads.append((key, data)) or key, lambda h: "packs/" + h)
    slots = [writer.add(bytes([i]) * 60) for i in range(5)]
    assert len(uploads) == 2  # sealed at 120 bytes twice, while adding
    handles = writer.finish()
    assert len(uploads) == 3 and handles == [key for key, _ in uploads]
    assert [s.offset for s in slots] == [0, 60, 0, 60, 0]
    for i, slot in enumerate(slots):
        data = dict(uploads)[slot.pack.key]
        assert data[slot.offset : slot.offset + 60] == bytes([i]) * 60
