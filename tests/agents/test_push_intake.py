"""The agent's push intake (agents/intake.py) on a real cache directory, and how long the gather
(agents/gather.py) waits for pushes before it fetches what is missing from the store.

Found by the demo (issue 16): during the warm start versions come every half second; a follower
needed the objects of a base its leader never relayed (superseded before it was sent), and waited
13-41 s for them because objects of *newer* versions kept arriving and counted as progress."""

from __future__ import annotations

import threading

import pytest

from weightsync.agents.cache import AgentCache
from weightsync.agents.config import AgentConfig
from weightsync.agents.gather import wait_for_pushes
from weightsync.agents.intake import Intake
from weightsync.agents.state import AgentState
from weightsync.format import layout
from weightsync.format.chunk import object_hash
from weightsync.format.manifest import ChunkRef
from weightsync.metrics import NULL_METRICS

MODEL = "intake-test-lm"


def _intake(tmp_path) -> tuple[Intake, AgentState, AgentCache]:
    config = AgentConfig(model=MODEL, cache_dir=str(tmp_path / "agent"))
    cache = AgentCache(config.cache_path, model=MODEL, name="a")
    state = AgentState(ledger_size=8)
    return Intake(config, state, cache, metrics=NULL_METRICS), state, cache


def _ref(data: bytes) -> tuple[str, ChunkRef]:
    address = object_hash(data)
    key = layout.chunk_key(address)
    return key, ChunkRef(start=0, stop=len(data), codec="full", raw=address, object=address, key=key, size=len(data))


@pytest.mark.timeout(120)
def test_pushes_of_other_objects_do_not_hold_back_a_fetch(tmp_path):
    intake, state, cache = _intake(tmp_path)
    key, ref = _ref(b"the base object nobody will push")
    others_done = threading.Event()
    stop = threading.Event()

    def push_other_objects() -> None:  # a newer version streaming in, object after object
        for i in range(600):
            if stop.wait(0.1):
                return
            data = f"object {i} of a newer version".encode()
            intake.receive_object(model=MODEL, version=9, address=object_hash(data), data=data)
        others_done.set()

    pusher = threading.Thread(target=push_other_objects)
    pusher.start()
    try:
        still_missing = wait_for_pushes(state, cache, {key: ref}, push_wait_s=1.0)
        assert still_missing == {key: ref}
        assert not others_done.is_set(), "the wait lasted as long as unrelated pushes went on"
    finally:
        stop.set()
        pusher.join()


def test_pushes_of_missing_objects_keep_the_wait_going(tmp_path):
    intake, state, cache = _intake(tmp_path)
    objects = [f"object {i} of the version".encode() for i in range(5)]
    refs = dict(_ref(data) for data in objects)

    def push() -> None:
        for data in objects:
            intake.receive_object(model=MODEL, version=3, address=object_hash(data), data=data)

    pusher = threading.Thread(target=push)
    pusher.start()
    assert wait_for_pushes(state, cache, refs, push_wait_s=30.0) == {}
    pusher.join()
