"""The Pusher against a real agent (gRPC on 127.0.0.1): a late object for a version the pusher is
done with does not stall the versions after it, confirmed objects leave its buffer, and a commit's
offer does not wait for the version's object stream to close."""

from __future__ import annotations

import threading
import time

from test_agents import MODEL, PUBLISH, PUSH_ONLY, PUSH_ONLY_GIVE_UP_S, WAIT_S, _agent, _assert_serves

from harness.fake_trainer import FakeTrainer
from weightsync.publisher import Publisher
from weightsync.stores import LocalStore
from weightsync.transport.push import PushConfig, Pusher


class Recorder:
    """A publish listener that keeps what the publisher made (to replay it late)."""

    def __init__(self) -> None:
        self.objects: list[tuple[int, str, bytes]] = []

    def on_object(self, version, object_xxh3, obj, placement=None):
        self.objects.append((version, object_xxh3, obj))

    def on_commit(self, manifest, manifest_bytes, signature):
        pass

    def on_failure(self, version, error):
        pass


def _wait_until_idle(pusher: Pusher) -> bool:
    """Whether the pusher had nothing left to send within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while not pusher.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pusher.idle()


def test_a_late_object_for_a_finished_version_does_not_stall_the_next(tmp_path):
    store = LocalStore(tmp_path / "store")
    agent = _agent(tmp_path, "a", store, **PUSH_ONLY)  # the push alone must carry it
    pusher = Pusher(PushConfig(targets=(agent.address,), model=MODEL, give_up_after_s=PUSH_ONLY_GIVE_UP_S))
    recorder = Recorder()
    trainer = FakeTrainer(11)
    try:
        with Publisher(store, model=MODEL, config=PUBLISH, listeners=[pusher, recorder]) as publisher:
            publisher.publish(trainer.state_dict()).result()
            _assert_serves(agent, 1, trainer.published())
            assert _wait_until_idle(pusher)
            version, address, obj = recorder.objects[0]
            pusher.on_object(version, address, obj)  # late: e.g. relayed after a store fetch
            trainer.step()
            result = publisher.publish(trainer.state_dict()).result()
            _assert_serves(agent, result.version, trainer.published())
        assert agent.agent.status()["ledger"][0]["bytes_fetched"] == 0, "v2 came by push, not from the store"
        assert _wait_until_idle(pusher), "the late object left a version behind that never finishes"
        assert pusher._targets[0]._buffered == 0, "confirmed objects were released"
    finally:
        pusher.close(timeout_s=5)
        agent.stop(0)


class OfferGate:
    """Makes an agent hold each pushed object of versions >= 2 until that version's offer has
    arrived: the last objects of a version still in flight on a slow link when it commits."""

    def __init__(self, intake) -> None:
        self._lock = threading.Lock()
        self._offered: dict[int, threading.Event] = {}
        self.waits: list[bool] = []  # per held object: whether its version's offer came (else it timed out)
        self._offer, self._receive = intake.offer, intake.receive_object
        intake.offer, intake.receive_object = self.offer, self.receive_object

    def _event(self, version: int) -> threading.Event:
        with self._lock:
            return self._offered.setdefault(version, threading.Event())

    def offer(self, **kwargs):
        result = self._offer(**kwargs)
        self._event(kwargs["version"]).set()
        return result

    def receive_object(self, **kwargs):
        if kwargs["version"] >= 2:
            self.waits.append(self._event(kwargs["version"]).wait(WAIT_S))
        return self._receive(**kwargs)


def test_the_offer_does_not_wait_for_the_version_s_object_stream_to_close(tmp_path):
    """The pusher offers a committed version while its object stream is still open. Waiting for
    the stream's reply first cost every version a round trip before the agent learnt of it; here
    the agent holds the stream until the offer comes, so a pusher that waited would time out."""
    store = LocalStore(tmp_path / "store")
    agent = _agent(tmp_path, "a", store, **PUSH_ONLY)
    gate = OfferGate(agent.agent.intake)
    pusher = Pusher(PushConfig(targets=(agent.address,), model=MODEL, give_up_after_s=PUSH_ONLY_GIVE_UP_S))
    recorder = Recorder()
    trainer = FakeTrainer(12)
    try:
        with Publisher(store, model=MODEL, config=PUBLISH, listeners=[pusher, recorder]) as publisher:
            publisher.publish(trainer.state_dict()).result()
            _assert_serves(agent, 1, trainer.published())
            trainer.step()
            result = publisher.publish(trainer.state_dict()).result()
            _assert_serves(agent, result.version, trainer.published())
            _wait_until_idle(pusher)
        assert gate.waits and all(gate.waits), "an object of v2 waited for an offer that never came while it was held"
        assert agent.agent.status()["ledger"][0]["bytes_fetched"] == 0, "v2 came by push, not from the store"
        made = {(version, address): len(obj) for version, address, obj in recorder.objects}  # equal chunks: one object
        assert pusher.stats()[agent.address]["sent_bytes"] == sum(made.values()), (
            "objects the offer overtook were sent again although the stream delivered them"
        )
    finally:
        pusher.close(timeout_s=5)
        agent.stop(0)


def test_a_relay_passes_an_early_offer_on_only_after_its_objects(tmp_path):
    """The leader gets v2's offer before v2's objects (OfferGate) and relays both to its follower.
    Relayed at once, the offer would reach the follower first; the leader's pusher would then be
    done with v2 and drop the objects that came after, and the follower, which does not poll the
    store here, would wait in vain. Held until the objects are here, everything arrives by push."""
    store = LocalStore(tmp_path / "store")
    follower = _agent(tmp_path, "follower", store, **PUSH_ONLY)
    leader = _agent(tmp_path, "leader", store, peers=[follower.address], **PUSH_ONLY)
    gate = OfferGate(leader.agent.intake)
    pusher = Pusher(PushConfig(targets=(leader.address,), model=MODEL, give_up_after_s=PUSH_ONLY_GIVE_UP_S))
    trainer = FakeTrainer(13)
    try:
        with Publisher(store, model=MODEL, config=PUBLISH, listeners=[pusher]) as publisher:
            for _ in range(2):
                result = publisher.publish(trainer.state_dict()).result()
                for agent in (leader, follower):
                    _assert_serves(agent, result.version, trainer.published())
                trainer.step()
        assert gate.waits and all(gate.waits), "the leader's objects of v2 were not held until its offer"
        for agent in (leader, follower):
            ledger = agent.agent.status()["ledger"]
            assert [e["version"] for e in ledger if e["outcome"] == "served"] == [2, 1]
            assert all(e["bytes_fetched"] == 0 for e in ledger), f"{agent.config.name} fetched from the store"
        assert [e["source"] for e in follower.agent.status()["ledger"]] == ["leader", "leader"]
    finally:
        pusher.close(timeout_s=5)
        leader.stop(0)
        follower.stop(0)


def test_a_version_that_never_commits_does_not_hold_back_the_next(tmp_path):
    """A relay gets objects of a version whose commit then fails upstream: no offer and no failure
    ever reach it. Here the version has nothing buffered either (no room), so no stream runs for
    it. Once a newer version's offer is queued the pusher gives that version up and delivers the
    offer; before, it waited on the version for good and queued every later one behind it."""
    store = LocalStore(tmp_path / "store")
    # Only an offer brings it a version; it fetches what no push brings at once.
    agent = _agent(tmp_path, "a", store, poll_interval_s=3600.0, push_wait_s=0.1)
    pusher = Pusher(
        PushConfig(targets=(agent.address,), model=MODEL, max_buffered_bytes=0, give_up_after_s=PUSH_ONLY_GIVE_UP_S)
    )
    recorder = Recorder()
    trainer = FakeTrainer(11)
    try:
        with Publisher(store, model=MODEL, config=PUBLISH, listeners=[recorder]) as publisher:
            results = []
            for step in range(3):
                trainer.advance_to(step)
                results.append(publisher.publish(trainer.state_dict()).result())
        version, address, obj = next(o for o in recorder.objects if o[0] == 2)
        pusher.on_object(version, address, obj)  # v2's object, which the relay has no room for; no offer follows
        latest = results[-1]
        pusher.offer(latest.version, latest.manifest.to_bytes(), None)
        _assert_serves(agent, latest.version, trainer.published())
        assert _wait_until_idle(pusher), "a version with nothing to send and no offer stayed queued"
        assert pusher._targets[0].dropped_objects == 1
    finally:
        pusher.close(timeout_s=5)
        agent.stop(0)


def test_a_version_left_with_nothing_to_send_gives_way_to_a_newer_offer():
    """A version with nothing to send and no offer (what a stream broken before the commit can
    leave once its resume finds nothing missing, when the commit then fails upstream) has nothing
    to wait for: once a newer offer is queued it is given up (the agent fetches from the store).
    Before, it held back every later version for good. The state is set up directly; the target
    refuses connections (a real socket, nothing listening)."""
    from weightsync.transport.push import _Version

    pusher = Pusher(
        PushConfig(targets=("127.0.0.1:1",), model=MODEL, give_up_after_s=3600.0, retry_backoff_s=(0.05, 0.1))
    )
    target = pusher._targets[0]
    try:
        with target._cond:
            target._versions[1] = _Version(1, time.monotonic())
        pusher.offer(2, b"manifest", None)
        deadline = time.monotonic() + WAIT_S
        while 1 in target._versions:
            assert time.monotonic() < deadline, "v1 still holds back v2 after a newer offer was queued"
            time.sleep(0.05)
    finally:
        pusher.close(timeout_s=0.1)
