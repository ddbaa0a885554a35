"""Sync agents over real gRPC (loopback, port 0): push, relay, verify, hot swap, catch up.

A publisher pushes every version to one leader per region (2 regions x 2 agents); leaders relay
to their followers; every agent serves the reference inference server in-process, and after
every publish each agent's served tensors are `torch.equal` to what the trainer published.
Faults: an object corrupted in flight, an agent offline for 5 versions, a region whose leader
is down, an agent SIGKILLed mid-stream, and offers that must be refused (bad token, bad or
missing signature, older version, tampered manifest, oversized message) without changing
anything an agent serves.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

from harness.bits import assert_bit_equal
from harness.fake_trainer import TINY, FakeTrainer
from weightsync.agents.config import AgentConfig
from weightsync.agents.server import AgentServer
from weightsync.errors import (
    AccessDenied,
    FormatError,
    ResourceExhausted,
    RpcUnavailable,
    SignatureError,
    StaleVersion,
)
from weightsync.models.probe import draw_prompts
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.stores import LocalStore
from weightsync.transport.push import PushConfig, Pusher
from weightsync.transport.rpc import AgentClient, ObjectFrame, TlsConfig
from weightsync.transport.signing import Signer
from weightsync.transport.v1 import sync_pb2
from weightsync.versions import read_manifest_bytes

MODEL = "agent-test-lm"
ARCH = TINY
ENGINE = {"type": "reference", "model": dataclasses.asdict(ARCH), "port": 0}
PUBLISH = PublisherConfig(chunk_bytes=16 * 1024, rebase_every=3, workers=2)
WAIT_S = 60
# An agent told to stop first waits for the codec-kernel compile under way (its warm-up, at low
# priority: minutes on a loaded machine, where CI runs). A deadline, not a timing assertion.
STOP_S = 600


def _agent(tmp_path, name: str, store: LocalStore | None, *, region: str = "r", peers=(), **settings) -> AgentServer:
    config = AgentConfig(
        model=MODEL,
        cache_dir=str(tmp_path / name),
        name=name,
        region=region,
        store=store.uri if store is not None else None,
        peers=tuple(peers),
        engine=ENGINE,
        poll_interval_s=settings.pop("poll_interval_s", 0.5),
        push_wait_s=settings.pop("push_wait_s", 1.0),
        workers=2,
        **settings,
    )
    return AgentServer(config).start()


def _assert_serves(server: AgentServer, version: int, want: dict[str, torch.Tensor]) -> None:
    assert server.agent.wait_for_version(version, WAIT_S), f"{server.config.name} never served v{version}"
    served = server.engine.served()
    assert served.version == version
    assert_bit_equal(served.weights, want)


PUSH_ONLY = {"poll_interval_s": 3600.0, "push_wait_s": float(WAIT_S)}
"""Agent settings for a test that asserts every version came by push: no store poll can see a commit
before its push lands (an agent fetches at once what nobody has pushed to it yet), and a push or
relay that a loaded machine stalls is waited for, not replaced by a store fetch. The store stays
the fallback for objects whose push makes no progress for push_wait_s. Pair it with a pusher that
does not give up on a slow version (PUSH_ONLY_GIVE_UP_S)."""
PUSH_ONLY_GIVE_UP_S = 10.0 * WAIT_S


@pytest.fixture
def agent_settings() -> dict:
    """The cluster's agent settings; a test overrides them with @pytest.mark.parametrize."""
    return {"push_wait_s": 5.0}


@pytest.fixture
def push_give_up_s() -> float:
    """How long the cluster's pusher retries a version (then the agents catch up from the store)."""
    return 20.0


@pytest.fixture
def cluster(tmp_path, agent_settings, push_give_up_s):
    """A store, 2 regions x 2 agents (leader relays to follower), and a pushing publisher."""
    store = LocalStore(tmp_path / "store")
    agents = {}
    for region in ("east", "west"):
        follower = _agent(tmp_path, f"{region}-2", store, region=region, **agent_settings)
        agents[f"{region}-2"] = follower
        agents[f"{region}-1"] = _agent(
            tmp_path, f"{region}-1", store, region=region, peers=[follower.address], **agent_settings
        )
    pusher = Pusher(
        PushConfig(
            targets=(agents["east-1"].address, agents["west-1"].address), model=MODEL, give_up_after_s=push_give_up_s
        )
    )
    publisher = Publisher(store, model=MODEL, config=PUBLISH, listeners=[pusher])
    yield store, agents, publisher, pusher
    publisher.close()
    pusher.close(timeout_s=5)
    for server in agents.values():
        server.stop(0)


@pytest.mark.parametrize(("agent_settings", "push_give_up_s"), [(PUSH_ONLY, PUSH_ONLY_GIVE_UP_S)], ids=["push-only"])
def test_every_agent_serves_every_version_bit_exactly(cluster):
    store, agents, publisher, pusher = cluster
    trainer = FakeTrainer()
    for step in range(6):
        version = publisher.publish(trainer.state_dict(), step=step).result().version
        want = trainer.published()
        for server in agents.values():
            _assert_serves(server, version, want)
        trainer.step()
    for name, server in agents.items():
        ledger = server.agent.status()["ledger"]
        assert [e["version"] for e in ledger if e["outcome"] == "served"] == [6, 5, 4, 3, 2, 1], name
        assert all(e["bytes_fetched"] == 0 for e in ledger), f"{name} fetched from the store: the push missed"
        # Leaders hear from the publisher, followers from their leader's relay (no store polls here).
        sender = "publisher" if name.endswith("-1") else name.replace("-2", "-1")
        assert [e["source"] for e in ledger if e["outcome"] == "served"] == [sender] * 6, name
        assert ledger[0]["path"].startswith(("deltas", "base"))
        timings = ledger[0]["timings_s"]
        assert 0 < timings["swap_pause"] <= timings["swap"] <= timings["total"], timings
    # The trainer sends each byte once per region, not once per agent: followers got theirs by relay.
    stored = sum(read_manifest_bytes(store, MODEL, v)[0].stored_bytes for v in range(1, 7))
    assert sum(s["sent_bytes"] for s in pusher.stats().values()) <= 2 * stored * 1.01


class CorruptingPusher(Pusher):
    """A faulty link between publisher and agent: flips a byte of the first `count` objects it sends
    (the pusher's buffer, hence its retries, keep the bad bytes too)."""

    def __init__(self, config, count: int) -> None:
        super().__init__(config)
        self.remaining = count

    def on_object(self, version, object_xxh3, obj, placement=None):
        if self.remaining > 0:
            self.remaining -= 1
            obj = bytes([obj[0] ^ 0xFF]) + obj[1:]
        super().on_object(version, object_xxh3, obj, placement)


def _wait_for_spare(agent: AgentServer, version: int):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        spare = agent.agent.buffers.spare
        if spare.manifest is not None and spare.manifest.version == version:  # None while it is rewritten
            return spare
        time.sleep(0.05)
    raise AssertionError(f"the spare buffer never caught up with v{version} in {WAIT_S} s")


def test_an_idle_agent_brings_its_spare_buffer_forward(tmp_path):
    """Zero-copy engines double-buffer; once idle, the agent catches the spare up with the served
    version (a copy of its bytes, in the spare's own memory), so the next version is one delta on
    the critical path, not two; a spare a failed sync left invalid is rebuilt the same way."""
    store = LocalStore(tmp_path / "store")
    agent = _agent(tmp_path, "a", store)
    pusher = Pusher(PushConfig(targets=(agent.address,), model=MODEL))
    trainer = FakeTrainer(12)
    with Publisher(store, model=MODEL, config=PUBLISH, listeners=[pusher]) as publisher:
        for step in range(3):
            version = publisher.publish(trainer.state_dict(), step=step).result().version
            served = trainer.published()
            _assert_serves(agent, version, served)
            trainer.step()
        spare = _wait_for_spare(agent, 3)
        assert_bit_equal(spare.state_dict(), served)
        held = agent.agent.buffers.served
        assert not any(np.shares_memory(spare.buffers[k], held.buffers[k]) for k in held.buffers)
        spare.buffers.clear()  # what a sync that failed mid-apply leaves (weightsync/reader.py)
        spare.manifest = None
        spare = _wait_for_spare(agent, 3)
        assert_bit_equal(spare.state_dict(), served)
        version = publisher.publish(trainer.state_dict(), step=3).result().version
        _assert_serves(agent, version, trainer.published())
    assert agent.agent.status()["ledger"][0]["path"] == "deltas 3->4"
    pusher.close(timeout_s=5)
    agent.stop(0)


def test_the_ledger_counts_as_pushed_only_what_came_by_push(tmp_path):
    """Found by a new user (issue 42): the ledger counted every object of a version's path that it
    did not fetch as pushed, cache hits included. An agent nobody pushes to serves v2 as its base
    v1 (cached since v1 was served) plus the delta: it fetched v2's objects, pushed nothing."""
    store = LocalStore(tmp_path / "store")
    agent = _agent(tmp_path, "a", store)
    trainer = FakeTrainer(3)
    try:
        with Publisher(store, model=MODEL, config=PUBLISH) as publisher:
            for step in range(2):
                version = publisher.publish(trainer.state_dict(), step=step).result().version
                _assert_serves(agent, version, trainer.published())
                trainer.step()
        manifest, _ = read_manifest_bytes(store, MODEL, 2)
        v2_bytes = sum(c.size for t in manifest.tensors for c in t.chunks if c.object)
        entry = next(e for e in agent.agent.status()["ledger"] if e["version"] == 2)
        assert entry["path"] == "base 1 + 1 deltas"  # v1's objects were cache hits
        assert (entry["bytes_pushed"], entry["bytes_fetched"]) == (0, v2_bytes)
    finally:
        agent.stop(0)


def test_an_object_corrupted_in_flight_is_refused_and_fetched_from_the_store(tmp_path):
    store = LocalStore(tmp_path / "store")
    agent = _agent(tmp_path, "a", store)
    pusher = CorruptingPusher(PushConfig(targets=(agent.address,), model=MODEL, give_up_after_s=3), count=1)
    trainer = FakeTrainer(1)
    with Publisher(store, model=MODEL, config=PUBLISH, listeners=[pusher]) as publisher:
        for step in range(2):
            version = publisher.publish(trainer.state_dict(), step=step).result().version
            _assert_serves(agent, version, trainer.published())
            trainer.step()
    assert "does not match its content address" in (pusher.stats()[agent.address]["last_error"] or "")
    first = [e for e in agent.agent.status()["ledger"] if e["version"] == 1][0]
    assert first["bytes_fetched"] > 0, "the refused object must have come from the store"
    pusher.close(timeout_s=5)
    agent.stop(0)


@pytest.mark.slow
def test_an_agent_offline_for_five_versions_catches_up(tmp_path, cluster):
    store, agents, publisher, _ = cluster
    trainer = FakeTrainer(2)
    version = publisher.publish(trainer.state_dict(), step=0).result().version
    for server in agents.values():
        _assert_serves(server, version, trainer.published())
    offline = agents.pop("west-2")
    offline.stop(0)
    for step in range(1, 6):
        trainer.step()
        version = publisher.publish(trainer.state_dict(), step=step).result().version
    want = trainer.published()
    for server in agents.values():
        _assert_serves(server, version, want)
    # Back with the same cache: it serves v1 from its cache first, then catches up.
    back = AgentServer(offline.config).start()
    agents["west-2"] = back
    _assert_serves(back, version, want)
    ledger = back.agent.status()["ledger"]
    assert ledger[-1]["path"] == "cache" and ledger[-1]["version"] == 1
    assert ledger[0]["version"] == 6 and ledger[0]["outcome"] == "served"


@pytest.mark.slow
def test_a_region_whose_leader_is_down_converges_from_the_store(cluster):
    store, agents, publisher, _ = cluster
    trainer = FakeTrainer(3)
    version = publisher.publish(trainer.state_dict(), step=0).result().version
    for server in agents.values():
        _assert_serves(server, version, trainer.published())
    agents.pop("west-1").stop(0)
    for step in (1, 2):
        trainer.step()
        version = publisher.publish(trainer.state_dict(), step=step).result().version  # never blocks on west
        want = trainer.published()
        for server in agents.values():
            _assert_serves(server, version, want)
    entry = agents["west-2"].agent.status()["ledger"][0]
    assert entry["source"] == "store" and entry["bytes_fetched"] > 0


@pytest.fixture
def guarded(tmp_path):
    """One agent requiring a token and signatures by a trusted key, serving v2 of a signed store."""
    signer = Signer.generate()
    signer.write(tmp_path / "pub.pem", tmp_path / "pub.pub")
    (tmp_path / "token").write_text("s3cret\n")
    store = LocalStore(tmp_path / "store")
    trainer = FakeTrainer(4)
    with Publisher(store, model=MODEL, config=PUBLISH, signer=signer) as publisher:
        for step in range(2):
            publisher.publish(trainer.state_dict(), step=step).result()
            trainer.step()
    agent = _agent(
        tmp_path,
        "guarded",
        store,
        token_file=str(tmp_path / "token"),
        trusted_keys=(str(tmp_path / "pub.pub"),),
        require_signatures=True,
    )
    assert agent.agent.wait_for_version(2, WAIT_S)
    yield agent, store, signer, trainer
    agent.stop(0)


def _served_snapshot(agent: AgentServer):
    served = agent.engine.served()
    return served.version, served.digest, {k: v.clone() for k, v in served.weights.items()}


def _unchanged(agent: AgentServer, before) -> None:
    version, digest, weights = _served_snapshot(agent)
    assert (version, digest) == before[:2]
    assert_bit_equal(weights, before[2])
    assert agent.agent.status()["current_version"] == version


def test_offers_that_must_be_refused_change_nothing(guarded, tmp_path):
    agent, store, signer, trainer = guarded
    before = _served_snapshot(agent)
    manifest2, data2 = read_manifest_bytes(store, MODEL, 2)
    manifest1, data1 = read_manifest_bytes(store, MODEL, 1)
    good = AgentClient(agent.address, token="s3cret")

    # A newer version, made by someone without the publisher's key.
    rogue_store = LocalStore(tmp_path / "rogue")
    trainer.step()
    with Publisher(rogue_store, model=MODEL, config=PublisherConfig(chunk_bytes=16 * 1024)) as rogue:
        rogue_manifest = rogue.publish(trainer.state_dict()).result().manifest
    rogue_bytes = rogue_manifest.to_bytes()
    rogue_v3 = dataclasses.replace(rogue_manifest, version=3, parent=None, base=3)

    cases = [
        (AccessDenied, AgentClient(agent.address, token="wrong"), dict(manifest=data2)),
        (AccessDenied, AgentClient(agent.address), dict(manifest=data2)),
        (SignatureError, good, dict(version=3, manifest=rogue_v3.to_bytes())),
        (
            SignatureError,
            good,
            dict(version=3, manifest=rogue_v3.to_bytes(), signature=Signer.generate().sign(rogue_v3.to_bytes())),
        ),
        (StaleVersion, good, dict(version=1, manifest=data1, signature=signer.sign(data1))),
        # Tampered after signing: parses, but the signature no longer matches.
        (
            SignatureError,
            good,
            dict(version=3, manifest=data2.replace(b'"version":2', b'"version":3'), signature=signer.sign(data2)),
        ),
        (FormatError, good, dict(version=3, manifest=rogue_bytes[:-5])),
        (FormatError, good, dict(version=3, manifest=rogue_v3.to_bytes(), model="other-model")),
    ]
    for error, client, fields in cases:
        request = sync_pb2.OfferRequest(model=fields.pop("model", MODEL), version=fields.pop("version", 2), **fields)
        with pytest.raises(error) as info:
            client.offer(request)
        assert str(info.value), "the refusal says why"
        _unchanged(agent, before)
    # A replay of the served version is harmless; a push of objects for it is ignored.
    reply = good.offer(sync_pb2.OfferRequest(model=MODEL, version=2, manifest=data2, signature=signer.sign(data2)))
    assert reply.decision == sync_pb2.OfferReply.NOT_NEEDED and reply.current_version == 2
    # Objects that do not hash to their address, and oversized messages, are refused.
    with pytest.raises(FormatError, match="content address"):
        good.push(iter([ObjectFrame(MODEL, 3, "0" * 32, b"x" * 100)]))
    with pytest.raises((ResourceExhausted, RpcUnavailable)):
        good.push(iter([ObjectFrame(MODEL, 3, "0" * 32, b"\0" * (80 * 1024 * 1024))]))
    with pytest.raises(AccessDenied):
        AgentClient(agent.address, token="wrong").push(iter([ObjectFrame(MODEL, 3, "0" * 32, b"x")]))
    with pytest.raises(AccessDenied):
        AgentClient(agent.address).status()
    _unchanged(agent, before)
    assert good.status().current_version == 2


def test_tls_and_mutual_tls(tmp_path):
    from harness.tls_certs import make_certificates

    certs = make_certificates(tmp_path)
    store = LocalStore(tmp_path / "store")
    server_tls = TlsConfig(cert=certs["server"], key=certs["server_key"], ca=certs["ca"], require_client_cert=True)
    agent = _agent(tmp_path, "tls", store, tls=server_tls, **PUSH_ONLY)
    port = agent.address.rsplit(":", 1)[1]
    target = f"localhost:{port}"
    client_tls = TlsConfig(ca=certs["ca"], cert=certs["client"], key=certs["client_key"])
    assert AgentClient(target, tls=client_tls).status().agent == "tls"
    for bad in (
        TlsConfig(ca=certs["ca"]),  # no client certificate
        TlsConfig(ca=certs["other_ca"], cert=certs["client"], key=certs["client_key"]),
    ):  # untrusted server
        with pytest.raises(RpcUnavailable):
            AgentClient(target, tls=bad).status(timeout_s=5)
    with pytest.raises(RpcUnavailable):
        AgentClient(target).status(timeout_s=5)  # plaintext to a TLS port

    pusher = Pusher(PushConfig(targets=(target,), model=MODEL, tls=client_tls, give_up_after_s=PUSH_ONLY_GIVE_UP_S))
    trainer = FakeTrainer(5)
    with Publisher(store, model=MODEL, config=PUBLISH, listeners=[pusher]) as publisher:
        version = publisher.publish(trainer.state_dict()).result().version
    _assert_serves(agent, version, trainer.published())
    assert agent.agent.status()["ledger"][0]["bytes_fetched"] == 0, "the version came by (TLS) push"
    pusher.close(timeout_s=5)
    agent.stop(0)


@pytest.mark.slow
def test_requests_during_continuous_swaps_see_one_version_each_never_going_backwards(cluster):
    store, agents, publisher, _ = cluster
    trainer = FakeTrainer(6)
    publisher.publish(trainer.state_dict(), step=0).result()
    leader = agents["east-1"]
    assert leader.agent.wait_for_version(1, WAIT_S)
    url = leader.engine.url + "/v1/generate"
    stop = threading.Event()
    seen: dict[int, list[int]] = {i: [] for i in range(3)}
    answered = threading.Condition()  # notified after each answer, so waits need no sleeps
    failures: list[str] = []

    def wait_until_every_client_saw(version: int) -> bool:
        with answered:
            return answered.wait_for(lambda: failures or all(version in vs for vs in seen.values()), WAIT_S)

    def client(i: int) -> None:
        body = json.dumps({"prompts": ["12+30=", "abc"], "max_new_tokens": 4, "temperature": 0}).encode()
        while not stop.is_set():
            try:
                request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=30) as response:
                    doc = json.loads(response.read())
                    assert int(response.headers["X-Weight-Version"]) == doc["weight_version"]
                with answered:
                    seen[i].append(doc["weight_version"])
                    answered.notify_all()
            except Exception as e:  # any failure is a test failure, reported below
                with answered:
                    failures.append(f"{type(e).__name__}: {e}")
                    answered.notify_all()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    # Every client is answered on v1 before the swaps start, and on the last version after them,
    # however slowly a loaded machine runs the requests in between.
    first_answers = wait_until_every_client_saw(1)
    for step in range(1, 8):
        trainer.step()
        version = publisher.publish(trainer.state_dict(), step=step).result().version
    assert leader.agent.wait_for_version(version, WAIT_S)
    last_answers = wait_until_every_client_saw(version)
    stop.set()
    for t in threads:
        t.join()
    assert not failures, failures[:3]
    assert first_answers and last_answers, f"clients not answered within {WAIT_S} s: {seen}"
    for versions in seen.values():
        assert versions and all(isinstance(v, int) and 1 <= v <= version for v in versions)
        assert versions == sorted(versions), "a client saw the served version go backwards"
    assert len({v for vs in seen.values() for v in vs}) > 1, "the clients saw the swaps happen"


@pytest.mark.slow
def test_an_agent_killed_mid_stream_restarts_and_converges(tmp_path):
    """A real agent process, SIGKILLed while a version streams into it; restarted on the same
    cache it serves its last good version, then converges on the new one."""
    store = LocalStore(tmp_path / "store")
    config = tmp_path / "agent.toml"
    engine = {k: v for k, v in ENGINE.items() if k != "model"}
    model_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in dataclasses.asdict(ARCH).items() if v is not None)
    config.write_text(
        "[agent]\n"
        f'model = "{MODEL}"\nname = "killed"\ncache_dir = "{tmp_path / "cache"}"\nstore = "{store.uri}"\n'
        "poll_interval_s = 0.5\npush_wait_s = 1.0\n"
        f"[agent.engine]\n"
        + "\n".join(f"{k} = {json.dumps(v)}" for k, v in engine.items())
        + "\n[agent.engine.model]\n"
        + model_lines
        + "\n"
    )

    def start():
        proc = subprocess.Popen(
            [sys.executable, "-m", "weightsync.app.cli", "agent", "--config", str(config)],
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready"
        return proc, ready["address"], ready["engine_url"]

    def engine_version(url):
        with urllib.request.urlopen(url + "/v1/version", timeout=10) as response:
            return json.loads(response.read())

    proc, address, url = start()
    trainer = FakeTrainer(7)
    slow_link = threading.Event()

    class SlowPusher(Pusher):
        """A slow link: objects trickle out, so the kill lands mid-stream."""

        def on_object(self, version, object_xxh3, obj, placement=None):
            if slow_link.is_set():
                time.sleep(0.05)
            super().on_object(version, object_xxh3, obj, placement)

    pusher = SlowPusher(PushConfig(targets=(address,), model=MODEL, give_up_after_s=5))
    try:
        with Publisher(
            store, model=MODEL, config=dataclasses.replace(PUBLISH, chunk_bytes=4096, workers=1), listeners=[pusher]
        ) as publisher:
            first = publisher.publish(trainer.state_dict(), step=0).result()
            deadline = time.monotonic() + WAIT_S
            while engine_version(url)["weight_version"] != 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            trainer.step()
            slow_link.set()
            pending = publisher.publish(trainer.state_dict(), step=1)
            chunks = tmp_path / "cache" / "store" / "models" / MODEL / "chunks"
            count_before = sum(len(files) for _, _, files in os.walk(chunks))
            deadline = time.monotonic() + WAIT_S
            while sum(len(files) for _, _, files in os.walk(chunks)) < count_before + 2:
                assert time.monotonic() < deadline, f"no object of v2 reached the agent in {WAIT_S} s"
                time.sleep(0.01)
            proc.send_signal(signal.SIGKILL)  # mid-stream: some objects of v2 arrived, most did not
            proc.wait()
            second = pending.result()
        proc, address, url = start()  # same cache: serves v1 at once, then catches up to v2
        deadline = time.monotonic() + WAIT_S
        while engine_version(url)["weight_version"] != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        info = engine_version(url)
        assert info["weight_version"] == 2 and info["weight_digest"] == second.manifest.digest
        status = AgentClient(address).status()
        assert status.current_version == 2 and status.current_digest == second.manifest.digest
        # What it served first, in its ledger (polling the engine right after the restart would race
        # the catch-up on a fast machine).
        served = [(e.version, e.path) for e in reversed(status.ledger) if e.outcome == "served"]
        assert served == [(1, "cache"), (2, served[-1][1])], "a restarted agent serves its last good version first"
        assert first.manifest.digest != second.manifest.digest
    finally:
        pusher.close(timeout_s=1)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STOP_S)


def test_verify_rehashes_the_served_bytes(cluster):
    store, agents, publisher, _ = cluster
    trainer = FakeTrainer(9)
    result = publisher.publish(trainer.state_dict()).result()
    for server in agents.values():
        assert server.agent.wait_for_version(result.version, WAIT_S)
        status = AgentClient(server.address).status(verify=True)
        assert status.served_digest == status.current_digest == result.manifest.digest
    # Memory corrupted under a served version (a stray write, a bad DIMM): verify says so.
    served = agents["east-1"].engine.served().weights["model.norm.weight"]
    served.view(torch.int16)[0] ^= 1
    status = AgentClient(agents["east-1"].address).status(verify=True)
    assert status.served_digest and status.served_digest != status.current_digest


def test_status_command_reports_the_ledger(cluster, capsys):
    from weightsync.app.cli import main

    store, agents, publisher, _ = cluster
    trainer = FakeTrainer(8)
    prompts = list(itertools.islice(draw_prompts(ARCH.vocab_size, length=8), 2))
    probe = trainer.probe(prompts)
    version = publisher.publish(trainer.state_dict(), probe=probe).result().version
    agent = agents["west-2"].agent
    assert agent.wait_for_version(version, WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while (agent.status()["parity"] or {}).get("version") != version:  # the probe runs after the swap
        assert time.monotonic() < deadline, agent.status()
        time.sleep(0.05)
    assert main(["status", "--agent", agents["west-2"].address, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["current_version"] == str(version) or row["current_version"] == version
    assert row["ledger"][0]["outcome"] == "served" and row["region"] == "west"
    assert row["ledger"][0]["parity"]["action"] == "ok" and row["parity"]["tokens"] == 14
    assert main(["status", "--agent", agents["west-2"].address, "--verify"]) == 0
    out = capsys.readouterr().out
    assert f"v{version}" in out and "bit-exact" in out
    assert f"parity v{version} on reference: held to the bfloat16 record, |dlogprob| median 0" in out
    assert out.rstrip().count(": ok") >= 1


@pytest.mark.timeout(1500)  # should the kernels not be cached yet, a low-priority compile: minutes on a busy machine
def test_an_agent_warms_up_the_codec_kernels_at_start_for_what_it_serves(tmp_path):
    # So that a machine whose numba cache is empty does not compile them inside its first delta.
    store = LocalStore(tmp_path / "store")
    first = _agent(tmp_path, "a", store)
    try:
        assert first.agent.warm_up.wait(timeout=900)  # low priority: minutes on a busy machine
        assert first.agent.warm_up.dtype_names == ["bfloat16"]  # nothing served yet: what publishers cast to
        trainer = FakeTrainer()
        with Publisher(store, model=MODEL, config=PUBLISH) as publisher:
            for step in range(2):  # a base and a delta
                version = publisher.publish(trainer.state_dict(), step=step).result().version
                trainer.step()
        assert first.agent.wait_for_version(version, WAIT_S)
    finally:
        first.stop()
    restarted = _agent(tmp_path, "a", store)  # the same cache: it serves the delta again first
    try:
        assert restarted.agent.served_version == version
        served = {t.dtype for t in restarted.agent.buffers.served.manifest.tensors}
        assert set(restarted.agent.warm_up.dtype_names) == served | {"bfloat16"}
    finally:
        restarted.stop()


def _wait_idle(pusher: Pusher, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pusher.idle():
        assert time.monotonic() < deadline, pusher.stats()
        time.sleep(0.05)


def test_a_pusher_takes_its_token_from_weightsync_token(guarded, tmp_path, monkeypatch):
    """As the README says: a publisher started with WEIGHTSYNC_TOKEN set pushes with it."""
    agent, store, signer, trainer = guarded
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", "s3cret")
    pusher = Pusher(PushConfig(targets=(agent.address,), model=MODEL))
    with Publisher(store, model=MODEL, config=PUBLISH, signer=signer, listeners=[pusher]) as publisher:
        version = publisher.publish(trainer.state_dict(), step=3).result().version
    _wait_idle(pusher)
    pusher.close()
    assert pusher.stats()[agent.address]["last_error"] is None
    assert agent.agent.wait_for_version(version, WAIT_S)
    entry = next(e for e in agent.agent.status()["ledger"] if e["version"] == version)
    assert entry["bytes_pushed"] > 0, entry


def test_a_refused_token_fails_the_push_at_once_and_loudly(guarded, tmp_path, monkeypatch, caplog):
    """A wrong token is not retried for give_up_after_s (120 s by default): the version is given up
    at the first refusal, logged at ERROR; the agent catches up from the store."""
    agent, store, signer, trainer = guarded
    monkeypatch.setenv("WEIGHTSYNC_TOKEN", "wrong")
    pusher = Pusher(PushConfig(targets=(agent.address,), model=MODEL, give_up_after_s=3600.0))
    with caplog.at_level(logging.ERROR, logger="weightsync.transport.push"):
        with Publisher(store, model=MODEL, config=PUBLISH, signer=signer, listeners=[pusher]) as publisher:
            publisher.publish(trainer.state_dict(), step=3).result()
        _wait_idle(pusher)  # an hour of retries otherwise
    pusher.close()
    assert "bearer token" in pusher.stats()[agent.address]["last_error"]
    assert any(r.levelno == logging.ERROR and "refused v3" in r.getMessage() for r in caplog.records), caplog.text
