"""Folded deltas (weightsync/format/codecs/fold.py): a reader several deltas behind applies them as one, range by
range, bit-exactly, in every codec; the chain when it cannot (chunk boundaries that differ, a base
on the path), with the reason; the agent's ledger records the route it took."""

from __future__ import annotations

import dataclasses
import time

import pytest

from harness.fake_trainer import TINY, FakeTrainer
from weightsync.agents.config import AgentConfig
from weightsync.agents.server import AgentServer
from weightsync.errors import IntegrityError
from weightsync.format.codecs import CODEC_SPARSE
from weightsync.format.codecs.fold import CHAIN, FOLDED, plan_route
from weightsync.format.layout import model_prefix
from weightsync.format.write_format import WriteFormat
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.stores import LocalStore
from weightsync.transport.push import PushConfig, Pusher
from weightsync.versions import read_manifest, read_manifest_bytes

MODEL = "fold/model"
WAIT_S = 60
XOR_CODECS = WriteFormat(highest_codec=CODEC_SPARSE)
"""These deltas are written in the XOR codecs (`xor`, `sparse`); `ctx`, the default at these
change rates, has its own test (test_ctx_deltas_fold_too)."""


def _series(make_state_dict, perturb, n: int) -> list[dict]:
    sds = [make_state_dict(5)]
    for i in range(1, n):
        sds.append(perturb(sds[-1], 0.03, seed=10 + i))
    return sds


def _publish(store, sds, **config) -> None:
    settings = {
        "chunk_bytes": 16 * 1024,
        "workers": 2,
        "rebase_every": 16,
        "rebase_chain_ratio": 1e9,
        "write_format": XOR_CODECS,
        **config,
    }
    with Publisher(store, model=MODEL, config=PublisherConfig(**settings)) as publisher:
        for sd in sds:
            publisher.publish(sd).result(timeout=WAIT_S)


@pytest.mark.parametrize("pack_bytes", [0, 64 * 1024], ids=["objects", "packs"])
def test_several_deltas_are_folded_bit_exactly(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal, pack_bytes
):
    sds = _series(make_state_dict, perturb, 5)
    _publish(tmp_store, sds, pack_bytes=pack_bytes)
    reader = Reader(tmp_store, model=MODEL)
    state = reader.read(1)
    route = reader.advance_route(state, 5)
    assert route.kind == FOLDED and [m.version for m in route.manifests] == [2, 3, 4, 5]
    assert "4 deltas v1->v5 applied as one" in route.reason
    assert state.manifest == read_manifest(tmp_store, MODEL, 5)
    assert_bit_equal(state.state_dict(), published_view(sds[4]))
    chained = reader.read(1)
    assert reader.advance_route(chained, 5, fold=False).kind == CHAIN
    assert_bit_equal(chained.state_dict(), state.state_dict())


def test_ctx_deltas_fold_too(tmp_store, make_state_dict, perturb, published_view, assert_bit_equal):
    """ctx decodes against its parent's bits: folded range by range, each delta finds them there."""
    sds = _series(make_state_dict, perturb, 4)
    _publish(tmp_store, sds, write_format=WriteFormat())
    used = {c.codec for v in (2, 3, 4) for t in read_manifest(tmp_store, MODEL, v).tensors for c in t.chunks}
    assert "ctx" in used
    reader = Reader(tmp_store, model=MODEL)
    state = reader.read(1)
    route = reader.advance_route(state, 4)
    assert route.kind == FOLDED and [m.version for m in route.manifests] == [2, 3, 4]
    assert_bit_equal(state.state_dict(), published_view(sds[3]))
    chained = reader.read(1)
    assert reader.advance_route(chained, 4, fold=False).kind == CHAIN
    assert_bit_equal(chained.state_dict(), state.state_dict())


def test_one_delta_and_a_state_off_the_chain_take_the_chain(tmp_store, make_state_dict, perturb):
    _publish(tmp_store, _series(make_state_dict, perturb, 3))
    reader = Reader(tmp_store, model=MODEL)
    state = reader.read(2)
    route = reader.advance_route(state, 3)
    assert (route.kind, route.reason) == (CHAIN, "one delta: nothing to fold")
    fresh = reader.read(1)
    fresh.manifest = None  # a state that holds nothing usable
    route = reader.advance_route(fresh, 3)
    assert route.kind == CHAIN and "from the base v1" in route.reason
    assert reader.advance_route(state, 3) is None  # already there


def test_a_path_through_a_base_and_folding_off_take_the_chain(tmp_store, make_state_dict, perturb):
    _publish(tmp_store, _series(make_state_dict, perturb, 3))
    v1, v2, v3 = (read_manifest(tmp_store, MODEL, v) for v in (1, 2, 3))
    assert plan_route([v2, v3]).kind == FOLDED
    assert plan_route([v1, v2, v3]).reason == "a full version first: nothing to fold"
    assert plan_route([v2, v3], fold=False).reason == "folding is off"


def test_chunk_boundaries_that_differ_take_the_chain(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal
):
    sds = _series(make_state_dict, perturb, 4)
    _publish(tmp_store, sds[:3])
    _publish(tmp_store, sds[3:], chunk_bytes=32 * 1024)  # a restarted publisher with other chunks
    reader = Reader(tmp_store, model=MODEL)
    state = reader.read(1)
    route = reader.advance_route(state, 4)
    assert route.kind == CHAIN and "chunk boundaries differ between v2 and v4" in route.reason
    assert_bit_equal(state.state_dict(), published_view(sds[3]))


def test_a_corrupt_object_fails_the_folded_apply_and_invalidates_the_state(tmp_store, make_state_dict, perturb):
    _publish(tmp_store, _series(make_state_dict, perturb, 4), pack_bytes=0)
    reader = Reader(tmp_store, model=MODEL)
    state = reader.read(1)
    v3 = read_manifest(tmp_store, MODEL, 3)
    ref = next(c for t in v3.tensors for c in t.chunks if c.key)
    data = bytearray(tmp_store.get(model_prefix(MODEL) + ref.key))
    data[80] ^= 1
    tmp_store.put(model_prefix(MODEL) + ref.key, bytes(data))
    with pytest.raises(IntegrityError):
        reader.advance_route(state, 4)
    assert state.manifest is None and not state.buffers  # read again from a base


def test_a_lagging_agent_records_the_folded_route_in_its_ledger(tmp_path):
    store = LocalStore(tmp_path / "store")
    config = AgentConfig(
        model=MODEL,
        cache_dir=str(tmp_path / "agent"),
        name="a",
        region="r",
        store=store.uri,
        engine={"type": "reference", "model": dataclasses.asdict(TINY), "port": 0},
        poll_interval_s=3600.0,
        push_wait_s=0.2,
        workers=2,
    )
    agent = AgentServer(config).start()
    pusher = Pusher(PushConfig(targets=(agent.address,), model=MODEL))
    trainer = FakeTrainer(7)
    settings = PublisherConfig(
        chunk_bytes=16 * 1024, workers=2, rebase_every=16, rebase_chain_ratio=1e9, write_format=XOR_CODECS
    )
    try:
        with Publisher(store, model=MODEL, config=settings, listeners=[pusher]) as publisher:
            for step in range(2):
                version = publisher.publish(trainer.state_dict(), step=step).result(timeout=WAIT_S).version
                assert agent.agent.wait_for_version(version, WAIT_S)
                trainer.step()
        deadline = time.monotonic() + WAIT_S  # the idle agent brings its spare buffer to v2
        while time.monotonic() < deadline:
            spare = agent.agent.buffers.spare
            if spare is not None and spare.manifest is not None and spare.manifest.version == 2:
                break
            time.sleep(0.05)
        # Three versions the agent does not hear of (nobody pushes, it does not poll)...
        with Publisher(store, model=MODEL, config=settings) as publisher:
            for step in range(2, 5):
                version = publisher.publish(trainer.state_dict(), step=step).result(timeout=WAIT_S).version
                trainer.step()
        # ...until the newest is offered: it fetches the three deltas and applies them as one.
        _, data = read_manifest_bytes(store, MODEL, version)
        pusher.offer(version, data, None)
        assert agent.agent.wait_for_version(version, WAIT_S)
        entry = agent.agent.status()["ledger"][0]
        assert entry["version"] == 5 and entry["path"] == "deltas 2->5"
        assert entry["route"] == FOLDED and "3 deltas v2->v5 applied as one" in entry["route_reason"]
        status = agent.agent.status()
        assert status["current_version"] == 5
        assert agent.agent.verify_served() == read_manifest(store, MODEL, 5).digest
    finally:
        pusher.close(timeout_s=5)
        agent.stop(0)
