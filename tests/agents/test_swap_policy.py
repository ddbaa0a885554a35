"""Swap policies at the agent (docs/agents.md, "Swap policies"), over real gRPC and a real store:
under drain a request running on the version two swaps back holds the next version back, the wait
is logged as it happens with its reason and kept in the ledger; an agent whose engine does not
implement its policy refuses to start. (What running requests see under each policy is tested on
the reference server itself: tests/agents/engines/test_reference_server.py.)"""

from __future__ import annotations

import dataclasses
import logging
import time

import pytest

from harness.fake_trainer import TINY, FakeTrainer
from weightsync.agents.config import AgentConfig
from weightsync.agents.server import AgentServer
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.stores import LocalStore

MODEL = "swap-policy-lm"
ENGINE = {"type": "reference", "model": dataclasses.asdict(TINY), "port": 0}
WAIT_S = 60


@pytest.mark.slow  # the wait is logged after 5 s
def test_drain_a_request_on_an_old_buffer_holds_the_next_version_logged_with_its_reason(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="weightsync")
    store = LocalStore(tmp_path / "store")
    config = AgentConfig(
        model=MODEL,
        cache_dir=str(tmp_path / "agent"),
        name="a",
        store=store.uri,
        engine=ENGINE,
        poll_interval_s=0.2,
        swap_policy="drain",
        workers=1,
    )
    server = AgentServer(config).start()
    trainer = FakeTrainer()
    try:
        with Publisher(store, model=MODEL, config=PublisherConfig(workers=1)) as publisher:

            def publish() -> int:
                trainer.step()
                return publisher.publish(trainer.state_dict(), step=trainer.step_count).result().version

            assert server.agent.wait_for_version(publish(), WAIT_S)
            with server.engine.lease() as held:  # a long request on v1
                assert held.version == 1
                assert server.agent.wait_for_version(publish(), WAIT_S)  # v2 is built in a fresh buffer
                v3 = publish()  # must be built in v1's buffer, which the request still uses
                deadline = time.monotonic() + WAIT_S
                while not any("waiting for requests still running on v1" in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, "the wait for requests was not logged"
                    time.sleep(0.1)
                assert server.agent.served_version == 2, "v3 must not be built while v1's buffer is in use"
            assert server.agent.wait_for_version(v3, WAIT_S)
        entry = next(e for e in server.agent.status()["ledger"] if e["version"] == v3)
        assert entry["timings_s"]["drain"] > 0 and entry["outcome"] == "served"
        assert "swap_policy drain" in next(
            r.getMessage() for r in caplog.records if "waiting for requests still running on v1" in r.getMessage()
        )
    finally:
        server.stop(0)


def test_an_engine_without_the_agents_policy_refuses_to_start(tmp_path):
    engine = {"type": "safetensors_dir", "root": str(tmp_path / "snapshots"), "model": dataclasses.asdict(TINY)}
    config = AgentConfig(model=MODEL, cache_dir=str(tmp_path / "agent"), engine=engine, swap_policy="in_flight")
    with pytest.raises(ValueError, match="does not implement swap policy 'in_flight'; it implements \\['drain'\\]"):
        AgentServer(config)


def test_an_engine_that_serves_whole_models_refuses_an_adapter_agent(tmp_path):
    engine = {"type": "safetensors_dir", "root": str(tmp_path / "snapshots"), "model": dataclasses.asdict(TINY)}
    config = AgentConfig(model=MODEL, cache_dir=str(tmp_path / "agent"), engine=engine, weights_kind="adapter")
    with pytest.raises(ValueError, match="serves \\['model'\\] weights, not 'adapter'.*lora_name"):
        AgentServer(config)
