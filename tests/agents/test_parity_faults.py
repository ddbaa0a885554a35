"""The wrong-engine suite: engines whose every byte verifies but which compute something else. Each
must breach the parity probe under the default thresholds (agents/parity.py), dense and MoE where
the fault applies; the test prints each case's margin (the breached figure over its threshold, the
largest; "inf" for a categorical breach), which docs/agents.md ("Parity probe") cites.

Each case runs a real agent over a store: the publisher writes a version with the probe a trainer
computes (harness/fake_trainer.py: records of the published weights, the training top-k, MoE
prompts repaired until every router picks every expert), the agent verifies every byte, swaps it
into the wrong engine, probes it under the defaults (action warn) and reports. The models are
initialised with std 0.1 (not 0.02): their logits spread as a trained model's do, where a
near-uniform random model would hide any fault.

Cases:
- config values that differ between trainer and engine: rope_theta; for MoE, norm_topk_prob and
  num_experts_per_tok;
- another compute dtype: an engine computing in float16, which the trainer recorded nothing for;
- two decoder layers' weights swapped after the digest; two experts' weights swapped (MoE, in
  every sparse layer, as one wrong expert map in the loader would);
- a router that picks other experts (its expert ids off by one, as a wrong expert map would make);
- a dropped final norm.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time

import pytest

from harness.fake_trainer import TINY, TINY_MOE, FakeTrainer
from harness.wrong_engines import CASES, wrong_engine
from weightsync.agents.config import AgentConfig
from weightsync.agents.parity import ParityConfig
from weightsync.agents.sync import SyncAgent
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.stores import LocalStore

WAIT_S = 120.0
DENSE = dataclasses.replace(TINY, initializer_range=0.1)
MOE = dataclasses.replace(TINY_MOE, initializer_range=0.1)
DEFAULTS = ParityConfig()
THRESHOLDS = {  # by architecture, as agents/parity.py `thresholds` picks them
    "dense": {"dlogprob_p50": DEFAULTS.max_dlogprob_p50, "dlogprob_p90": DEFAULTS.max_dlogprob_p90},
    "moe": {
        "dlogprob_p50": DEFAULTS.moe_max_dlogprob_p50,
        "dlogprob_p90": DEFAULTS.moe_max_dlogprob_p90,
        "expert_mismatch": DEFAULTS.max_expert_mismatch,
    },
}


PARAMS = [pytest.param(case, arch, id=f"{arch}-{case.replace(' ', '-')}") for case, archs in CASES for arch in archs]


def margins(report: dict, arch_name: str) -> dict[str, float]:
    """Each alarm figure over its threshold (the largest is the case's margin); {"compute_dtype":
    inf} for a categorical breach (no figure)."""
    if report["dlogprob_p50"] is None:
        return {"compute_dtype": math.inf}
    limits = THRESHOLDS[arch_name]
    return {f: report[f] / limit for f, limit in limits.items() if report.get(f) is not None}


@pytest.mark.parametrize(("case", "arch_name"), PARAMS)
def test_a_wrong_engine_breaches_the_defaults(case, arch_name, tmp_path, capsys):
    arch = DENSE if arch_name == "dense" else MOE
    trainer = FakeTrainer(seed=3, config=arch)
    prompts = trainer.choose_prompts()
    store = LocalStore(tmp_path / "store")
    engine = wrong_engine(case, arch)
    config = AgentConfig(model="m", cache_dir=str(tmp_path / "agent"), store=store.uri, poll_interval_s=0.2)
    agent = SyncAgent(config, engine, upstream=store)  # the default [agent.parity]: warn, default thresholds
    agent.start()
    try:
        with Publisher(store, model="m", config=PublisherConfig(workers=2)) as publisher:
            trainer.advance_to(1)
            publisher.publish(trainer.state_dict(), step=1, probe=trainer.probe(prompts)).result(WAIT_S)
        assert agent.wait_for_version(1, WAIT_S)  # every byte verified, swapped in
        deadline = time.monotonic() + WAIT_S
        while (report := agent.status()["parity"]) is None:
            assert time.monotonic() < deadline, agent.status()
            time.sleep(0.05)
    finally:
        agent.close()
    assert agent.status()["current_version"] == 1
    assert report["action"] == "warn" and report["breaches"], json.dumps(report)
    ratios = margins(report, arch_name)
    assert max(ratios.values()) > 1
    figures = {k: report[k] for k in ("dlogprob_p50", "dlogprob_p90", "expert_mismatch", "gap_kl")}
    with capsys.disabled():
        print(
            json.dumps(
                {"wrong_engine": case, "arch": arch_name, "margin": max(ratios.values()), "margins": ratios, **figures}
            )
        )
