"""The chaos harness (bench/chaos.py) as a test: a few seeded rounds of faults against a real cluster
(a publisher process, 2 regions x 2 agent processes, a store), with zero invariant violations.

`python -m bench.chaos --rounds 100` is the long run; CI runs 10 rounds on a local store and 2 on S3
(moto behind tests/fault_proxy.py). What the rounds do and which invariants they check is in the
module docstring of bench/chaos.py. Every process the harness starts is stopped by PID when it ends.
"""

from __future__ import annotations

import json

import pytest

from bench.chaos import FAULT_KINDS, ChaosConfig, run_chaos

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _check(summary: dict, rounds: int) -> None:
    print(json.dumps(summary, indent=1))
    assert summary["violations"] == 0, summary["violation_details"]
    assert summary["rounds"] == rounds
    assert summary["versions_committed"] >= rounds * 3
    assert set(summary["faults"]) <= set(FAULT_KINDS)
    assert sum(summary["faults"].values()) >= rounds, "every round injects at least one fault"
    assert summary["convergence_s"]["p50"] is not None and summary["convergence_s"]["max"] <= summary["convergence_s"]["bound"]
    checks = summary["checks"]
    assert checks["served_observations"] > 0 and checks["verify_calls"] > 0
    assert checks["generation_checks"] >= 4 * rounds and checks["versions_verified"] >= rounds


def test_ten_chaos_rounds_on_a_local_store_violate_nothing(tmp_path):
    summary = run_chaos(ChaosConfig(rounds=10, seed=7, store="local", workdir=str(tmp_path / "chaos")))
    _check(summary, 10)
    assert len([k for k, n in summary["faults"].items() if n]) >= 6, summary["faults"]


@pytest.mark.s3
def test_chaos_rounds_on_s3_through_faults_violate_nothing(tmp_path):
    summary = run_chaos(ChaosConfig(rounds=2, seed=11, store="s3", workdir=str(tmp_path / "chaos")))
    _check(summary, 2)
    assert summary["faults"].get("s3_faults", 0) >= 1
    assert sum(summary["fault_details"]["s3_injected"].values()) > 0
