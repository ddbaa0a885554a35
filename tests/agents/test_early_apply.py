"""Pushed chunks applied as they arrive (agents/early_apply.py), against a real agent over gRPC on
127.0.0.1: the offer finds the version's chunks applied, a placement the signed manifest does not
confirm is redone from the parent's bytes, and what is served is bit for bit what was published."""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
from test_agents import MODEL, PUSH_ONLY, PUSH_ONLY_GIVE_UP_S, WAIT_S, _agent, _assert_serves

from harness.fake_trainer import FakeTrainer
from weightsync.format.chunk import object_hash, pack_chunk
from weightsync.format.codecs import CODEC_FULL
from weightsync.format.dtypes import dtype_by_name
from weightsync.format.hashing import xxh3_digest
from weightsync.format.manifest import ChunkPlacement
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.stores import LocalStore
from weightsync.transport.push import PushConfig, Pusher
from weightsync.transport.rpc import AgentClient, ObjectFrame

PUBLISH = PublisherConfig(chunk_bytes=16 * 1024, rebase_every=100, workers=2)


class CommitAfterObjects:
    """A publish listener in front of a Pusher that holds each commit until the agent holds every
    object of the version: the objects then all arrive before the offer, and which of them were
    applied early no longer depends on thread timing."""

    def __init__(self, pusher: Pusher, agent) -> None:
        self.pusher, self.agent = pusher, agent
        self.addresses: dict[int, set[str]] = {}
        self.placements: dict[str, ChunkPlacement] = {}

    def on_object(self, version, object_xxh3, obj, placement):
        self.addresses.setdefault(version, set()).add(object_xxh3)
        self.placements[object_xxh3] = placement
        self.pusher.on_object(version, object_xxh3, obj, placement)

    def on_commit(self, manifest, manifest_bytes, signature):
        deadline = time.monotonic() + WAIT_S
        cache = self.agent.agent.cache
        while not all(cache.has_object(a) for a in self.addresses.get(manifest.version, ())):
            assert time.monotonic() < deadline, f"v{manifest.version}'s objects never reached the agent"
            time.sleep(0.01)
        self.pusher.on_commit(manifest, manifest_bytes, signature)

    def on_failure(self, version, error):
        self.pusher.on_failure(version, error)


def _wait_for_caught_up_spare(agent) -> None:
    """Until the agent's spare buffer holds the served version (what early applies need)."""
    deadline = time.monotonic() + WAIT_S
    buffers = agent.agent.buffers
    while True:
        spare, served = buffers.spare, buffers.served
        if (
            spare is not None
            and spare.manifest is not None
            and served is not None
            and served.manifest is not None
            and spare.manifest.digest == served.manifest.digest
        ):
            return
        assert time.monotonic() < deadline, "the agent's spare never caught up with the served version"
        time.sleep(0.01)


def _ledger(agent, version: int) -> dict:
    return next(e for e in agent.agent.status()["ledger"] if e["version"] == version)


def _object_chunks(manifest) -> int:
    return sum(1 for t in manifest.tensors for c in t.chunks if c.object is not None)


def test_pushed_chunks_are_applied_before_the_offer_and_served_bit_exactly(tmp_path):
    store = LocalStore(tmp_path / "store")
    agent = _agent(tmp_path, "a", store, **PUSH_ONLY)
    pusher = Pusher(PushConfig(targets=(agent.address,), model=MODEL, give_up_after_s=PUSH_ONLY_GIVE_UP_S))
    gate = CommitAfterObjects(pusher, agent)
    trainer = FakeTrainer(21)
    try:
        with Publisher(store, model=MODEL, config=PUBLISH, listeners=[gate]) as publisher:
            for version in range(1, 5):
                if version >= 3:  # from the second swap on, the spare holds the served version
                    _wait_for_caught_up_spare(agent)
                result = publisher.publish(trainer.state_dict()).result()
                assert result.version == version
                _assert_serves(agent, version, trainer.published())
                entry = _ledger(agent, version)
                if version >= 3:
                    assert result.manifest.kind == "delta"
                    assert entry["applied_early"] == _object_chunks(result.manifest) > 0, entry
                    # Both are recorded; how they compare is up to the scheduler (under load the
                    # sync can start waiting before the first early decode starts), so no order.
                    assert entry["timings_s"]["early_apply"] > 0 and entry["timings_s"]["early_wait"] >= 0
                else:  # v1 is a base, and v2's spare did not exist yet: applied after the offer
                    assert entry["applied_early"] == 0
                assert entry["bytes_fetched"] == 0
                trainer.step()
        assert all(
            p.parent == p_version - 1
            for p_version, addresses in gate.addresses.items()
            if p_version > 1
            for p in (gate.placements[a] for a in addresses)
        ), "a delta chunk's placement names its parent"
    finally:
        pusher.close(timeout_s=5)
        agent.stop(0)


def test_a_forged_chunk_applied_early_is_redone_and_never_served(tmp_path):
    """Someone who can push (a token is not a signature) sends a well-formed full chunk with a
    placement over one of v3's ranges before v3's own objects. It decodes, so it is applied early;
    the signed manifest names another object for that range, so the agent puts the parent's bytes
    back there and applies the real chunk. The real chunk for that range overlapped the forged one
    and was not applied early; every other range was."""
    store = LocalStore(tmp_path / "store")
    agent = _agent(tmp_path, "a", store, **PUSH_ONLY)
    pusher = Pusher(PushConfig(targets=(agent.address,), model=MODEL, give_up_after_s=PUSH_ONLY_GIVE_UP_S))
    gate = CommitAfterObjects(pusher, agent)
    trainer = FakeTrainer(22)
    try:
        with Publisher(store, model=MODEL, config=PUBLISH, listeners=[gate]) as publisher:
            for version in (1, 2):
                publisher.publish(trainer.state_dict()).result()
                _assert_serves(agent, version, trainer.published())
                trainer.step()
            _wait_for_caught_up_spare(agent)
            served = agent.agent.buffers.served
            tensor = next(t for t in served.manifest.tensors if t.dtype == "bfloat16")
            ref = tensor.chunks[0]
            dtype = dtype_by_name(tensor.dtype)
            forged_raw = np.random.default_rng(5).integers(0, 2**16, ref.stop - ref.start, dtype=np.uint16).tobytes()
            forged = pack_chunk(CODEC_FULL, 0, dtype, ref.stop - ref.start, xxh3_digest(forged_raw), forged_raw)
            address = object_hash(forged)
            AgentClient(agent.address).push(
                iter([ObjectFrame(MODEL, 3, address, forged, ChunkPlacement(tensor.name, ref.start, ref.stop, 2))])
            )
            result = publisher.publish(trainer.state_dict()).result()
            _assert_serves(agent, 3, trainer.published())
        entry = _ledger(agent, 3)
        assert entry["applied_early"] == _object_chunks(result.manifest) - 1, entry
        assert address not in {c.object for t in result.manifest.tensors for c in t.chunks}
    finally:
        pusher.close(timeout_s=5)
        agent.stop(0)


def test_chunks_of_a_version_that_never_commits_do_not_reach_the_next_one(tmp_path):
    """A publisher pushes v3's objects, which the agent applies early, and dies before its commit.
    Another publisher on the store publishes other weights as v3: the manifest confirms none of
    the stale ranges, so the agent puts v2's bytes back there and serves the new v3 bit for bit.
    The new v3's chunks for those ranges overlap the stale ones and wait for the offer; its
    chunks for the other ranges are applied early as usual."""
    store = LocalStore(tmp_path / "store")
    agent = _agent(tmp_path, "a", store, **PUSH_ONLY)
    pusher = Pusher(PushConfig(targets=(agent.address,), model=MODEL, give_up_after_s=PUSH_ONLY_GIVE_UP_S))
    trainer = FakeTrainer(23)
    try:
        with Publisher(store, model=MODEL, config=PUBLISH, listeners=[pusher]) as publisher:
            for version in (1, 2):
                publisher.publish(trainer.state_dict()).result()
                _assert_serves(agent, version, trainer.published())
                trainer.step()
        _wait_for_caught_up_spare(agent)
        # The dead publisher: the same chain, other weights for v3, its commit never reaches the store.
        shutil.copytree(tmp_path / "store", tmp_path / "lost")
        stale = FakeTrainer(24)
        recorder = _Recorder()
        with Publisher(LocalStore(tmp_path / "lost"), model=MODEL, config=PUBLISH, listeners=[recorder]) as lost:
            assert lost.publish(stale.state_dict()).result().version == 3
        stale_v3 = [(a, o, p) for v, a, o, p in recorder.objects if v == 3]
        assert stale_v3 and all(p.parent == 2 for _, _, p in stale_v3)
        AgentClient(agent.address).push(iter([ObjectFrame(MODEL, 3, a, o, p) for a, o, p in stale_v3]))
        early = agent.agent.early
        deadline = time.monotonic() + WAIT_S
        while early._claim is None or early._claim.running or len(early._claim.applied) < len(stale_v3):
            assert time.monotonic() < deadline, "the stale objects were never applied early"
            time.sleep(0.01)
        with Publisher(store, model=MODEL, config=PUBLISH, listeners=[CommitAfterObjects(pusher, agent)]) as publisher:
            result = publisher.publish(trainer.state_dict()).result()
            assert result.version == 3
            _assert_serves(agent, 3, trainer.published())
        # Early: only the new v3's chunks whose ranges the stale ones left alone.
        stale_ranges = {(p.tensor, p.start, p.stop) for _, _, p in stale_v3}
        fresh = [
            c
            for t in result.manifest.tensors
            for c in t.chunks
            if c.object is not None and (t.name, c.start, c.stop) not in stale_ranges
        ]
        assert _ledger(agent, 3)["applied_early"] == len(fresh) < _object_chunks(result.manifest)
    finally:
        pusher.close(timeout_s=5)
        agent.stop(0)


class _Recorder:
    """A publish listener that keeps what the publisher made."""

    def __init__(self) -> None:
        self.objects: list = []
        self.lock = threading.Lock()

    def on_object(self, version, object_xxh3, obj, placement):
        with self.lock:
            self.objects.append((version, object_xxh3, obj, placement))

    def on_commit(self, manifest, manifest_bytes, signature):
        pass

    def on_failure(self, version, error):
        pass
