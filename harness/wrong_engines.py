"""wrong_engines: inference engines whose every byte verifies but which compute something else.

The wrong-engine suite of the parity probe (tests/agents/test_parity_faults.py) and its benchmark on
real checkpoints (bench/parity_faults.py) build them here: the reference engine after a wrong load
(layers or experts swapped, a router's rows out of order), with a config value read otherwise, in
another compute dtype, or computing without its final norm. `CASES` lists them with the
architectures they apply to; `wrong_engine(case, arch)` builds one.

Not here: the probe (weightsync.agents.parity), the right engine (weightsync.agents.engines.reference).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from weightsync.agents.engines.base import PromptLogprobs
from weightsync.agents.engines.reference import ReferenceEngine, ReferenceEngineConfig
from weightsync.models import ModelConfig
from weightsync.models.probe import run_top_k


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


def wrong_engine(case: str, arch: ModelConfig) -> ReferenceEngine:
    """The wrong engine of `case` (one of CASES) for models of `arch`."""
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
