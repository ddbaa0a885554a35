"""Sharded publish (weightsync/shards.py): N ranks each encode only their own dim-0 shards and one
manifest commits once every rank's part is durable. Ranks are threads here, each with its own
Publisher over the same store, exactly as N trainer processes would be (the publisher never
uses torch.distributed); the trainer's own tests run the same over torchrun.
"""

from __future__ import annotations

import concurrent.futures as cf
import math

import pytest
import torch

from weightsync.errors import PublishError, StoreError
from weightsync.format import layout
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.reader import Reader
from weightsync.shards import Placement, ShardSpec
from weightsync.stores import LocalStore
from weightsync.transport.signing import Signer, Verifier
from weightsync.versions import list_versions, read_manifest_bytes, read_signature

CONFIG = PublisherConfig(chunk_bytes=8 * 1024, workers=2)


def _shard(full: dict[str, torch.Tensor], rank: int, world: int) -> tuple[dict, dict]:
    """Rank `rank`'s dim-0 shard of every >=1-dim tensor (uneven, like FSDP2's torch.chunk
    split; a rank may get nothing), and the 0-dim/odd tensors whole on rank 0 only."""
    tensors, placements = {}, {}
    for name, t in full.items():
        if t.dim() == 0 or t.shape[0] < world:
            if rank == 0:
                tensors[name] = t
            continue
        rows = math.ceil(t.shape[0] / world)
        lo, hi = min(rank * rows, t.shape[0]), min((rank + 1) * rows, t.shape[0])
        tensors[name] = t[lo:hi]
        placements[name] = Placement(global_shape=tuple(t.shape), start=lo * math.prod(t.shape[1:]))
    return tensors, placements


def _publishers(store, world: int, session: str, **kwargs) -> list[Publisher]:
    return [
        Publisher(
            store,
            model="m",
            config=CONFIG,
            shard=ShardSpec(rank=r, world_size=world, session=session, commit_timeout_s=30),
            **kwargs,
        )
        for r in range(world)
    ]


def _publish_all(publishers, full, step, skip=()) -> list[cf.Future]:
    world = len(publishers)
    futures = []
    for rank, publisher in enumerate(publishers):
        if rank in skip:
            continue
        tensors, placements = _shard(full, rank, world)
        futures.append(publisher.publish(tensors, step=step, placements=placements))
    return futures


def _state(seed: int, make_state_dict) -> dict[str, torch.Tensor]:
    sd = make_state_dict(seed)
    sd["odd.rows"] = torch.randn(3, 40)  # 3 rows over 4 ranks: rank 3 gets an empty shard
    return sd


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_versions_read_back_bit_exactly(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal, world
):
    publishers = _publishers(tmp_store, world, "s1")
    sd = _state(1, make_state_dict)
    expected = {}
    for step in range(4):
        results = [f.result(timeout=60) for f in _publish_all(publishers, sd, step)]
        assert {r.version for r in results} == {step + 1}
        assert len({r.manifest.digest for r in results}) == 1, "every rank reports the one committed manifest"
        expected[step + 1] = published_view(sd)
        sd = perturb(sd, 0.02, step)
    for p in publishers:
        p.close()
    assert list_versions(tmp_store, "m") == [1, 2, 3, 4]
    reader = Reader(tmp_store, model="m")
    kinds = []
    for version, want in expected.items():
        state = reader.read(version)
        kinds.append(state.manifest.kind)
        assert state.manifest.producer["ranks"] == world and state.manifest.producer["session"] == "s1"
        assert_bit_equal(state.state_dict(), want)
    assert kinds == ["full", "delta", "delta", "delta"]
    assert not list(tmp_store.list(layout.parts_prefix("m"))), "parts are cleaned up after each commit"


class FailingStore(LocalStore):
    """The same directory as seen by one rank whose uploads fail while `fail` is set."""

    fail = False

    def put(self, key, data):
        if self.fail and ("/chunks/" in key or "/packs/" in key):
            raise StoreError("injected: this rank's upload failed")
        super().put(key, data)


def test_a_failing_rank_aborts_the_version_for_every_rank(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal
):
    flaky = FailingStore(tmp_store.root)
    ranks = [
        Publisher(
            tmp_store if r == 0 else flaky,
            model="m",
            config=CONFIG,
            shard=ShardSpec(rank=r, world_size=2, session="s1", commit_timeout_s=30),
        )
        for r in range(2)
    ]
    sd = _state(2, make_state_dict)
    for f in _publish_all(ranks, sd, 0):
        f.result(timeout=60)
    sd = perturb(sd, 0.02, 1)
    flaky.fail = True
    futures = _publish_all(ranks, sd, 1)
    for f in futures:
        with pytest.raises(PublishError):
            f.result(timeout=60)  # rank 0 learns it from rank 1's abort marker, not a timeout
    assert list_versions(tmp_store, "m") == [1], "no partial version is ever visible"

    flaky.fail = False
    # v3 was planned before every rank could know v2's fate (max_in_flight 2), so every rank
    # planned it as a delta on v2, and it fails on every rank alike; v4 is the first version
    # planned past v2, and every rank makes it full: the ranks never disagree.
    for f in _publish_all(ranks, perturb(sd, 0.02, 2), 2):
        with pytest.raises(PublishError):
            f.result(timeout=60)
    sd = perturb(sd, 0.02, 3)
    results = [f.result(timeout=60) for f in _publish_all(ranks, sd, 3)]
    assert results[0].version == 4 and results[0].manifest.kind == "full", "the ranks re-agree via a full version"
    sd2 = perturb(sd, 0.02, 4)
    assert _publish_all(ranks, sd2, 4)[0].result(timeout=60).manifest.kind == "delta"
    for p in ranks:
        p.close()
    assert list_versions(tmp_store, "m") == [1, 4, 5]
    assert_bit_equal(Reader(tmp_store, model="m").read(4).state_dict(), published_view(sd))
    assert_bit_equal(Reader(tmp_store, model="m").read(5).state_dict(), published_view(sd2))


def test_ranks_agree_on_rebases_whatever_the_timing(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal
):
    """The ratio rebase depends on committed bytes, which ranks learn at different moments: with a
    tiny rebase_chain_ratio and publishes not waited for, every version must still commit."""
    config = PublisherConfig(chunk_bytes=8 * 1024, workers=2, rebase_chain_ratio=0.05, max_in_flight=2)
    ranks = [
        Publisher(
            tmp_store, model="m", config=config, shard=ShardSpec(rank=r, world_size=2, session="s", commit_timeout_s=30)
        )
        for r in range(2)
    ]
    sd = _state(6, make_state_dict)
    futures, expected = [], {}
    for step in range(8):
        futures += _publish_all(ranks, sd, step)
        expected[step + 1] = published_view(sd)
        sd = perturb(sd, 0.02, step + 10)
    results = [f.result(timeout=120) for f in futures]
    for p in ranks:
        p.close()
    assert list_versions(tmp_store, "m") == list(range(1, 9))
    kinds = {r.version: r.manifest.kind for r in results}
    assert "full" in list(kinds.values())[1:], "the ratio rule did rebase"
    reader = Reader(tmp_store, model="m")
    for version, want in expected.items():
        assert_bit_equal(reader.read(version).state_dict(), want)


@pytest.mark.slow
def test_a_missing_rank_times_out_and_a_new_session_resumes(
    tmp_store, make_state_dict, perturb, published_view, assert_bit_equal
):
    ranks = [
        Publisher(
            tmp_store,
            model="m",
            config=CONFIG,
            shard=ShardSpec(rank=r, world_size=2, session="dead", commit_timeout_s=1.5),
        )
        for r in range(2)
    ]
    sd = _state(3, make_state_dict)
    for f in _publish_all(ranks, sd, 0):
        f.result(timeout=60)
    (alone,) = _publish_all(ranks, perturb(sd, 0.02, 1), 1, skip={1})  # rank 1 "died" before publishing
    with pytest.raises(PublishError, match=r"no part from ranks \[1\]"):
        alone.result(timeout=60)
    ranks[0].close()
    ranks[1].close(wait=False)
    assert list_versions(tmp_store, "m") == [1]

    # The restarted job: a new session; its first version is full and numbers continue.
    restarted = _publishers(tmp_store, 2, "restarted")
    sd = perturb(sd, 0.02, 2)
    results = [f.result(timeout=60) for f in _publish_all(restarted, sd, 2)]
    assert results[0].version == 2 and results[0].manifest.kind == "full"
    for p in restarted:
        p.close()
    assert_bit_equal(Reader(tmp_store, model="m").read(2).state_dict(), published_view(sd))


@pytest.mark.slow
def test_parts_of_another_session_are_never_merged(tmp_store, make_state_dict):
    sd = _state(4, make_state_dict)
    old = Publisher(
        tmp_store, model="m", config=CONFIG, shard=ShardSpec(rank=1, world_size=2, session="old", commit_timeout_s=1)
    )
    tensors, placements = _shard(sd, 1, 2)
    with pytest.raises(PublishError):  # its rank 0 never comes: it leaves a part (and an abort) behind
        old.publish(tensors, step=0, placements=placements).result(timeout=60)
    old.close()
    assert list(tmp_store.list(layout.parts_prefix("m", 1, "old")))
    new = Publisher(
        tmp_store, model="m", config=CONFIG, shard=ShardSpec(rank=0, world_size=2, session="new", commit_timeout_s=1)
    )
    tensors, placements = _shard(sd, 0, 2)
    with pytest.raises(PublishError, match=r"no part from ranks \[1\]"):
        new.publish(tensors, step=0, placements=placements).result(timeout=60)
    new.close()
    assert list_versions(tmp_store, "m") == []


def test_placements_are_checked(tmp_store):
    with pytest.raises(ValueError, match="sharded publisher"):
        Publisher(tmp_store, model="m").publish({"w": torch.zeros(4)}, placements={"w": Placement((8,), 0)})
    p = Publisher(tmp_store, model="m", shard=ShardSpec(rank=0, world_size=1, session="s"))
    with pytest.raises(ValueError, match="does not fit"):
        p.publish({"w": torch.zeros(4)}, placements={"w": Placement((6,), 4)})
    with pytest.raises(ValueError, match="not in the state dict"):
        p.publish({"w": torch.zeros(4)}, placements={"x": Placement((4,), 0)})
    p.close()
    with pytest.raises(ValueError, match="rank"):
        ShardSpec(rank=2, world_size=2, session="s")
    with pytest.raises(Exception, match="session"):
        ShardSpec(rank=0, world_size=2, session="../x")


def test_sharded_versions_are_signed_by_rank_0(tmp_store, make_state_dict):
    signer = Signer.generate()
    ranks = [
        Publisher(
            tmp_store,
            model="m",
            config=CONFIG,
            signer=signer if r == 0 else None,
            shard=ShardSpec(rank=r, world_size=2, session="s", commit_timeout_s=30),
        )
        for r in range(2)
    ]
    for f in _publish_all(ranks, _state(5, make_state_dict), 0):
        f.result(timeout=60)
    for p in ranks:
        p.close()
    _, data = read_manifest_bytes(tmp_store, "m", 1)
    assert Verifier([signer._key.public_key()]).verify(data, read_signature(tmp_store, "m", 1, data)) == signer.key_id
