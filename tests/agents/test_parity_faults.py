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
import torch
from torch import nn

from harness.fake_trainer import TINY, FakeTrainer
from weightsync.agents.config import AgentConfig
from weightsync.agents.engines.base import PromptLogprobs
from weightsync.agents.engines.reference import ReferenceEngine, ReferenceEngineConfig
from weightsync.agents.parity import ParityConfig
from weightsync.agents.sync import SyncAgent
from weightsync.models import ModelConfig
from weightsync.models.probe import run_top_k
from weightsync.publisher import Publisher, PublisherConfig
from weightsync.stores import LocalStore

WAIT_S = 120.0
DENSE = dataclasses.replace(TINY, initializer_range=0.1)
MOE = ModelConfig(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    model_type="qwen3_moe",
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    initializer_range=0.1,
)
THRESHOLDS = {
    "dlogprob_p50": ParityConfig().max_dlogprob_p50,
    "dlogprob_p90": ParityConfig().max_dlogprob_p90,
    "expert_mismatch": ParityConfig().max_expert_mismatch,
}


class LoadsWrong(ReferenceEngine):
    """The reference engine after a wrong load: `transform` rewrites the tensors after the agent
    verified them (swapped layers or experts, a router's rows out of order)."""

    def __init__(self, config: ReferenceEngineConfig, transform) -> None:
        super().__init__(config)
        self.transform = transform

    def swap(self, version, weights, **kwargs):
        return super().swap(version, self.transform(dict(weights)), **kwargs)


class DropsFinalNorm(ReferenceEngine):
    """The reference engine computing without the final RMSNorm (a model class that forgot it);
    it exposes no routing, as vLLM does not."""

    def prompt_logprobs(self, prompts, *, timeout_s=60.0, top_k=0):
        model = self._replicas.get()
        try:
            model.model.norm = nn.Identity()
            with self.lease() as served:
                weights = {n: t for n, t in served.weights.items() if n != "model.norm.weight"}
                run = run_top_k(lambda ids: model(ids, weights=weights), prompts, top_k or 1)
        finally:
            self._replicas.put(model)
        return PromptLogprobs(
            version=served.version,
            logprobs=run.logprobs,
            compute_dtype=self.config.compute_dtype,
            top_ids=run.top_ids if top_k else None,
            top_logprobs=run.top_logprobs if top_k else None,
        )


def _swap_prefixes(a: str, b: str):
    def transform(weights):
        out = dict(weights)
        for name in weights:
            if name.startswith(a):
                other = b + name[len(a) :]
                out[name], out[other] = weights[other], weights[name]
        return out

    return transform


def _swap_experts(weights):
    """Experts 0 and 1 of every sparse layer exchanged, as a loader's wrong expert map would."""
    out = dict(weights)
    for name in weights:
        if ".mlp.experts.0." in name:
            other = name.replace(".mlp.experts.0.", ".mlp.experts.1.")
            out[name], out[other] = weights[other], weights[name]
    return out


def _roll_router(weights):
    out = dict(weights)
    for name in weights:
        if name.endswith("mlp.gate.weight"):
            out[name] = torch.roll(weights[name], 1, dims=0)  # expert e's row is served as e + 1's
    return out


def _engine(case: str, arch: ModelConfig) -> ReferenceEngine:
    configs = {
        "config rope_theta x100": dataclasses.replace(arch, rope_theta=arch.rope_theta * 100),
        "config norm_topk_prob flipped": dataclasses.replace(arch, norm_topk_prob=not arch.norm_topk_prob),
        "config num_experts_per_tok + 1": dataclasses.replace(arch, num_experts_per_tok=arch.num_experts_per_tok + 1),
    }
    if case in configs:
        return ReferenceEngine(ReferenceEngineConfig(model=configs[case]))
    if case == "compute dtype float16":
        return ReferenceEngine(ReferenceEngineConfig(model=arch, compute_dtype="float16"))
    if case == "final norm dropped":
        return DropsFinalNorm(ReferenceEngineConfig(model=arch))
    transforms = {
        "layers 0 and 1 swapped": _swap_prefixes("model.layers.0.", "model.layers.1."),
        "experts 0 and 1 swapped": _swap_experts,
        "router picks other experts": _roll_router,
    }
    return LoadsWrong(ReferenceEngineConfig(model=arch), transforms[case])


CASES = [
    ("config rope_theta x100", ("dense", "moe")),
    ("config norm_topk_prob flipped", ("moe",)),
    ("config num_experts_per_tok + 1", ("moe",)),
    ("compute dtype float16", ("dense", "moe")),
    ("layers 0 and 1 swapped", ("dense", "moe")),
    ("experts 0 and 1 swapped", ("moe",)),
    ("router picks other experts", ("moe",)),
    ("final norm dropped", ("dense", "moe")),
]
PARAMS = [pytest.param(case, arch, id=f"{arch}-{case.replace(' ', '-')}") for case, archs in CASES for arch in archs]


def margin(report: dict) -> float:
    """The largest breached figure over its threshold (inf: a categorical breach, no figure)."""
    ratios = [report[f] / limit for f, limit in THRESHOLDS.items() if report.get(f) is not None and limit > 0]
    if report["dlogprob_p50"] is None:
        return math.inf
    return max(ratios)


@pytest.mark.parametrize(("case", "arch_name"), PARAMS)
def test_a_wrong_engine_breaches_the_defaults(case, arch_name, tmp_path, capsys):
    arch = DENSE if arch_name == "dense" else MOE
    trainer = FakeTrainer(seed=3, config=arch)
    prompts = trainer.choose_prompts()
    store = LocalStore(tmp_path / "store")
    engine = _engine(case, arch)
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
    figures = {k: report[k] for k in ("dlogprob_p50", "dlogprob_p90", "expert_mismatch", "gap_kl")}
    with capsys.disabled():
        print(json.dumps({"wrong_engine": case, "arch": arch_name, "margin": margin(report), **figures}))
