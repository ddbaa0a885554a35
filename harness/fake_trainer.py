"""fake_trainer: the trainer's stand-in for tests and benchmarks that need versions of a model.

fp32 master weights of a small decoder (weightsync.models); each step nudges ~5 % of them, so
consecutive bf16 versions differ sparsely, as in RL. The weights of a step depend only on (seed,
step), so a restarted publisher and a checker rebuild the same ones. `probe` computes the
parity probe the real trainer would publish with them (trainer/probe.py, without the sharding).
Not here: the real trainer (weightsync.trainer), publishing (the callers own their Publisher).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from weightsync.format.probe import Probe
from weightsync.models import ModelConfig, build_model
from weightsync.models.probe import (
    DEFAULT_PROMPTS,
    DEFAULT_TOP_K,
    cover_experts,
    draw_prompts,
    run_probe,
    run_top_k,
    to_probe,
)

TINY = ModelConfig(
    vocab_size=259,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""A decoder small enough for many agents on 2 cores (a byte vocabulary plus specials)."""

TINY_MOE = ModelConfig(
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
)
"""Its Qwen3-MoE sibling: 8 experts, top-2, in both layers."""


class FakeTrainer:
    """Stands in for the trainer: fp32 master weights, nudged sparsely each step."""

    def __init__(self, seed: int = 0, *, config: ModelConfig = TINY) -> None:
        self.seed = seed
        self.model = build_model(config, seed=seed)
        self.step_count = 0
        """The step the weights are at (0: as built)."""

    def step(self) -> None:
        """One optimizer step: ~5 % of each parameter moves by ~1 % of its mean magnitude."""
        self.step_count += 1
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step_count)
        with torch.no_grad():
            for p in self.model.parameters():
                mask = torch.rand(p.shape, generator=g) < 0.05
                p.add_(mask * torch.randn(p.shape, generator=g) * 1e-2 * p.abs().mean())

    def advance_to(self, step: int) -> None:
        if step < self.step_count:
            raise ValueError(f"the trainer is at step {self.step_count}; it cannot go back to {step}")
        while self.step_count < step:
            self.step()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights, what a Publisher is handed."""
        return self.model.state_dict()

    def published(self) -> dict[str, torch.Tensor]:
        """What a publisher casting floats to bf16 publishes for the current step."""
        return {name: t.detach().to(torch.bfloat16) for name, t in self.model.state_dict().items()}

    def probe(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        dtypes: Sequence[str] = ("bfloat16", "float32"),
        top_k: int = DEFAULT_TOP_K,
    ) -> Probe:
        """The parity probe of the current step, as the trainer computes it (`trainer_probe`)."""
        return trainer_probe(
            self.published(), self.model.config, prompts, master=self.model, dtypes=dtypes, top_k=top_k
        )

    def choose_prompts(self, *, count: int = DEFAULT_PROMPTS, length: int = 32) -> list[list[int]]:
        """The run's probe prompts as the trainer chooses them (`choose_prompts`)."""
        return choose_prompts(self.published(), self.model.config, count=count, length=length)


def trainer_probe(
    published: Mapping[str, torch.Tensor],
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    *,
    master: torch.nn.Module | None = None,
    dtypes: Sequence[str] = ("bfloat16", "float32"),
    top_k: int = DEFAULT_TOP_K,
) -> Probe:
    """The parity probe the trainer publishes (trainer/probe.py, without the sharding): records of
    the `published` (bf16) weights in each of `dtypes`, and the training forward's top-k: `master`'s
    (fp32 master weights), else the published weights' in fp32."""
    compute = [getattr(torch, d) for d in dtypes]
    runs = run_probe(config, prompts, published.__getitem__, dtypes=compute)
    training = None
    if top_k:
        model, weights = build_model(config), {n: t.float() for n, t in published.items()}

        def forward(ids: torch.Tensor) -> torch.Tensor:
            return master(ids) if master is not None else model(ids, weights=weights)

        training = run_top_k(forward, prompts, top_k)
    return to_probe(prompts, {d: runs[c] for d, c in zip(dtypes, compute, strict=True)}, training=training)


def choose_prompts(
    published: Mapping[str, torch.Tensor], config: ModelConfig, *, count: int = DEFAULT_PROMPTS, length: int = 32
) -> list[list[int]]:
    """The run's probe prompts as the trainer chooses them (trainer/probe.py): drawn, and for a MoE
    model repaired until every router picks every expert (from a pool four times as large)."""
    draws = draw_prompts(config.vocab_size, length=length)
    prompts = list(itertools.islice(draws, count))
    if not config.is_moe:
        return prompts
    pool = prompts + list(itertools.islice(draws, 4 * count))
    run = run_probe(config, pool, published.__getitem__, dtypes=[torch.bfloat16])[torch.bfloat16]
    return cover_experts(config, pool, run, keep=count, room=count)[0]
