"""The chaos benchmark (bench/chaos/) as a test: a few seeded rounds of faults against a real cluster
(a publisher process, 2 regions x 2 agent processes, a store), with zero invariant violations.

`python -m bench.chaos --rounds 100` is the long run; CI runs 5 rounds on a local store (seed 7 draws
every fault kind but S3's in them), its agents under the three swap policies at once (`--swap-policy
mixed`: drain, in_flight, abort, in_flight), and on S3 (moto behind harness/fault_proxy.py, swap
policy drain) one round, through the same command line (tests never import bench/).
What the rounds do and which invariants they check is in bench/chaos/__init__.py. Every process the
harness starts is stopped by PID when it ends.

Below them, small deterministic tests for what the chaos runs found in the push path (fast, not slow).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.agents.config import AgentConfig
from weightsync.agents.server import AgentServer
from weightsync.transport.push import PushConfig, Pusher

REPO = Path(__file__).resolve().parent.parent
FAULT_KINDS = (
    "kill_publisher",
    "kill_agent",
    "stall_agent",
    "partition_leader",
    "flip_in_flight",
    "flip_store_object",
    "flip_agent_cache",
    "stale_cache_restart",
    "s3_faults",
    "clock_skew",
    "gc_during_publish",
)
"""What bench/chaos injects (its config.FAULT_KINDS): a kind added there is added here."""
WAIT_S = 30  # liveness bound for the push-path tests (a tiny model on loopback)


def _check(summary: dict, rounds: int) -> None:
    print(json.dumps(summary, indent=1))
    assert summary["violations"] == 0, summary["violation_details"]
    assert summary["rounds"] == rounds
    assert summary["versions_committed"] >= rounds * 3
    assert set(summary["faults"]) <= set(FAULT_KINDS)
    assert sum(summary["faults"].values()) >= rounds, "every round injects at least one fault"
    assert (
        summary["convergence_s"]["p50"] is not None
        and summary["convergence_s"]["max"] <= summary["convergence_s"]["bound"]
    )
    checks = summary["checks"]
    assert checks["served_observations"] > 0 and checks["verify_calls"] > 0
    assert checks["generation_checks"] >= 4 * rounds and checks["versions_verified"] >= rounds
    assert checks["generation_ranges_checked"] >= 4 * rounds, "long generations ran and were checked per token range"


def run_chaos(tmp_path: Path, *, rounds: int, seed: int, store: str, swap_policy: str = "drain") -> dict:
    """`python -m bench.chaos` as a user runs it; the summary of its one store from the JSON record."""
    command = [
        sys.executable,
        "-m",
        "bench.chaos",
        "--rounds",
        str(rounds),
        "--seed",
        str(seed),
        "--store",
        store,
        "--workdir",
        str(tmp_path / "chaos"),
        "--swap-policy",
        swap_policy,
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=880, check=False)
    try:
        record = json.loads(done.stdout)
    except ValueError:
        pytest.fail(f"{' '.join(command[1:])} exited {done.returncode} without a JSON record:\n{done.stderr[-5000:]}")
    assert done.returncode == (1 if record["violations"] else 0), done.stderr[-5000:]
    return record["results"][store]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_rounds_on_a_local_store_violate_nothing(tmp_path):
    """Under every swap policy at once (one cluster, a policy per agent): running requests wait for
    (drain), move to (in_flight) or restart on (abort) each new version, and every token range still
    comes from a committed version's bytes. The rounds' faults are drawn from the seed alone: these
    5 inject every kind a local store can have."""
    summary = run_chaos(tmp_path, rounds=5, seed=7, store="local", swap_policy="mixed")
    _check(summary, 5)
    assert {k for k, n in summary["faults"].items() if n} == set(FAULT_KINDS) - {"s3_faults"}, summary["faults"]
    for policy in ("drain", "in_flight", "abort"):
        assert summary["checks"].get(f"generation_ranges_checked_{policy}", 0) > 0, (policy, summary["checks"])


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.timeout(900)
def test_chaos_rounds_on_s3_through_faults_violate_nothing(tmp_path):
    summary = run_chaos(tmp_path, rounds=1, seed=11, store="s3")  # seed 11 draws S3 faults in round 1
    _check(summary, 1)
    assert summary["faults"].get("s3_faults", 0) >= 1
    assert sum(summary["fault_details"]["s3_injected"].values()) > 0


# ------------------------------------------------------------------------------ the push path


@pytest.fixture(scope="module")
def gen():
    """Versions of a tiny model, from the agent hostile corpus's generator."""
    path = Path(__file__).parent / "hostile" / "agent" / "make_agent_hostile.py"
    spec = importlib.util.spec_from_file_location("make_agent_hostile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def push_only_agent(gen, tmp_path):
    """An agent without a store: every version must reach it by push."""
    config = AgentConfig(
        model=gen.MODEL,
        cache_dir=str(tmp_path / "cache"),
        name="push-only",
        workers=1,
        push_wait_s=0.5,
        engine={"type": "reference", "model": dataclasses.asdict(gen.ARCH), "port": 0, "torch_threads": 1},
    )
    server = AgentServer(config).start()
    yield server
    server.stop(0)


def _publish(gen, pusher: Pusher, version: int, parent: int | None) -> str:
    """What a publisher's listeners see for one version: its objects, then the commit."""
    weights = gen.weights(version)
    manifest, objects = gen.encode_version(
        weights,
        None if parent is None else gen.weights(parent),
        version=version,
        parent_version=parent,
        base=1,
        step=version,
    )
    for address, obj in objects.items():
        pusher.on_object(version, address, obj)
    pusher.on_commit(manifest, manifest.to_bytes(), None)
    return manifest.digest


@pytest.fixture
def pushers():
    made = []

    def make(agent: AgentServer, model: str) -> Pusher:
        pusher = Pusher(
            PushConfig(targets=(agent.address,), model=model, give_up_after_s=600, retry_backoff_s=(0.1, 1.0))
        )
        made.append(pusher)
        return pusher

    yield make
    for pusher in made:
        pusher.close(timeout_s=1)


@pytest.mark.slow
def test_a_stale_offer_does_not_hold_back_the_versions_after_it(gen, push_only_agent, pushers):
    """A relay that offers a version its peer already passed (the peer caught up from the store)
    gets FAILED_PRECONDITION: that version is done for that peer, and the next one must follow.
    (bench/chaos saw a leader retry such an offer until give_up_after_s, its follower getting
    no pushes meanwhile.)"""
    agent = push_only_agent
    first = pushers(agent, gen.MODEL)
    _publish(gen, first, 1, None)
    _publish(gen, first, 2, 1)
    assert agent.agent.wait_for_version(2, WAIT_S)
    late = pushers(agent, gen.MODEL)  # a second sender that is behind: its v1 is stale
    _publish(gen, late, 1, None)
    digest = _publish(gen, late, 3, 2)
    assert agent.agent.wait_for_version(3, WAIT_S), f"v3 stuck behind the stale v1: {late.stats()}"
    assert agent.engine.served().digest == digest


@pytest.mark.slow
def test_a_pusher_survives_a_reply_lost_on_the_link(gen, push_only_agent, pushers):
    agent = push_only_agent
    pusher = pushers(agent, gen.MODEL)
    target = pusher._targets[0]  # the one target's grpc call: where a corrupting link hands back None
    real_offer, lost = target.client._offer, []

    def offer_with_one_reply_lost(request, *args, **kwargs):
        """Stands in for a link that drops one reply's DATA frame: grpc-python then returns None."""
        reply = real_offer(request, *args, **kwargs)
        if not lost:
            lost.append(request.version)
            return None
        return reply

    target.client._offer = offer_with_one_reply_lost
    _publish(gen, pusher, 1, None)
    digest = _publish(gen, pusher, 2, 1)
    assert agent.agent.wait_for_version(2, WAIT_S), f"the pusher stopped after a lost reply: {pusher.stats()}"
    assert lost and agent.engine.served().digest == digest
