"""Retention: gc keeps the newest versions, their whole chains, protected versions and young
unreferenced chunks (an in-flight publish's), and deletes the rest; every kept version reads."""

from __future__ import annotations

import os
import time

import pytest
import torch

from weightsync.format.layout import chunk_key, model_prefix
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.stores import LocalStore
from weightsync.stores.retention import apply_gc, collect_garbage, plan_gc
from weightsync.versions import list_versions

MODEL = "gc-model"


def _publish(store, count: int, rebase_every: int) -> None:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(128, 128, generator=g), "n": torch.ones(128)}
    # Bases exactly every rebase_every + 1 versions, whatever the deltas weigh.
    config = PublisherConfig(
        chunk_bytes=8192, rebase_every=rebase_every, rebase_chain_ratio=1e9, parent_from_store=False
    )
    with Publisher(store, model=MODEL, config=config) as publisher:
        for _ in range(count):
            publisher.publish(state).result()
            state = {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def _age_everything(store: LocalStore, seconds: float) -> None:
    past = time.time() - seconds
    for info in store.list():
        os.utime(store.root / info.key, (past, past))


def test_keeps_newest_versions_with_their_chains(tmp_path):
    store = LocalStore(tmp_path)
    _publish(store, 8, rebase_every=3)  # bases at 1 and 5
    _age_everything(store, 7200)
    plan = collect_garbage(store, MODEL, keep=2, grace_s=3600)
    assert plan.keep_versions == (5, 6, 7, 8) and plan.delete_versions == (1, 2, 3, 4)
    assert list_versions(store, MODEL) == [5, 6, 7, 8]
    reader = Reader(store, model=MODEL)
    for version in (5, 6, 7, 8):
        reader.read(version)
    remaining = {info.key for kind in ("chunks/", "packs/") for info in store.list(model_prefix(MODEL) + kind)}
    needed = set()
    for version in (5, 6, 7, 8):
        needed |= {model_prefix(MODEL) + k for k in reader.read(version).manifest.objects()}
    assert remaining == needed  # nothing unreferenced left, nothing referenced gone


def test_protected_versions_and_their_chains_survive(tmp_path):
    store = LocalStore(tmp_path)
    _publish(store, 8, rebase_every=3)
    _age_everything(store, 7200)
    plan = collect_garbage(store, MODEL, keep=1, protect={3}, grace_s=3600)
    assert plan.keep_versions == (1, 2, 3, 5, 6, 7, 8)
    Reader(store, model=MODEL).read(3)


def test_young_unreferenced_chunks_survive_the_grace_period(tmp_path):
    store = LocalStore(tmp_path)
    _publish(store, 2, rebase_every=8)
    # A chunk an in-flight publish wrote but has not committed yet.
    in_flight = model_prefix(MODEL) + chunk_key("ab" * 16)
    store.put(in_flight, b"x" * 100)
    plan = plan_gc(store, MODEL, keep=1, grace_s=3600)
    assert in_flight not in plan.delete_objects and plan.young_unreferenced == 1
    plan = plan_gc(store, MODEL, keep=1, grace_s=0)
    assert in_flight in plan.delete_objects


def test_dry_run_deletes_nothing_and_crashed_temp_files_are_collected(tmp_path):
    store = LocalStore(tmp_path)
    _publish(store, 3, rebase_every=8)
    stray = store.root / model_prefix(MODEL) / "chunks" / ".tmp-crashed"
    stray.write_bytes(b"half a chunk")
    before = sorted(i.key for i in store.list())
    plan = collect_garbage(store, MODEL, keep=1, grace_s=0, dry_run=True)
    assert sorted(i.key for i in store.list()) == before and stray.exists()
    apply_gc(store, plan, grace_s=0)
    assert not stray.exists() and list_versions(store, MODEL) == [1, 2, 3]  # a chain: all needed


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="at least 1"):
        plan_gc(LocalStore(tmp_path), MODEL, keep=0)


def test_an_object_touched_after_planning_is_spared(tmp_path):
    """A publisher reusing an old chunk touches it before committing; gc must not delete it."""
    store = LocalStore(tmp_path)
    _publish(store, 8, rebase_every=3)
    _age_everything(store, 7200)
    plan = plan_gc(store, MODEL, keep=2, grace_s=3600)
    reused = plan.delete_objects[0]
    store.touch(reused)  # what Publisher._write_object does for an existing chunk
    apply_gc(store, plan, grace_s=3600)
    assert store.exists(reused)
    assert not any(store.exists(key) for key in plan.delete_objects[1:])


def test_signatures_follow_their_versions_and_stale_parts_age_out(tmp_path):
    from weightsync.format import layout
    from weightsync.transport.signing import Signer
    from weightsync.versions import read_manifest_bytes, read_signature

    store = LocalStore(tmp_path)
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(64, 64, generator=g)}
    config = PublisherConfig(chunk_bytes=8192, rebase_every=0)  # every version full
    with Publisher(store, model=MODEL, config=config, signer=Signer.generate()) as publisher:
        for _ in range(3):
            publisher.publish(state).result()
            state = {"w": state["w"] + 1e-2 * torch.randn(64, 64, generator=g)}
    stale_part = layout.part_key(MODEL, 9, "dead-session", 1)
    store.put(stale_part, b"{}")
    fresh_part = layout.part_key(MODEL, 10, "live-session", 0)
    _age_everything(store, 7200)
    store.put(fresh_part, b"{}")  # an in-flight sharded publish: younger than the grace period

    collect_garbage(store, MODEL, keep=1, grace_s=3600)
    assert list_versions(store, MODEL) == [3]
    signatures = [info.key for info in store.list(layout.signatures_prefix(MODEL))]
    assert [layout.version_from_signature_key(MODEL, k) for k in signatures] == [3]
    _, data = read_manifest_bytes(store, MODEL, 3)
    assert read_signature(store, MODEL, 3, data) is not None
    assert not store.exists(stale_part) and store.exists(fresh_part)
