"""probe: running a parity probe's prompts through a model — the trainer's side and the reference
engine's side of the same computation.

Both sides call `run_probe` with the same prompts, one forward pass per prompt length (the
prompts of a length as one batch, in a fixed order), so that where they hold the same weights in
the same compute dtype they run the very same kernels on the very same shapes: the reference engine then matches the trainer to
the last bits, and any difference the probe reports comes from the weights or the engine, not
from batching. For MoE models it also records the experts each sparse layer's router chose at
every position (top-k of the router logits, sorted ids).

What a trainer probes with (`default_prompts` + `greedy_extend`): each prompt is one seeded random
start token continued by the model's own greedy tokens, once per run (the first version's model);
every later version is probed on the same tokens, so figures compare across versions. So every
scored token is one the model finds likely, as the tokens RL samples are: a random token that the
model gives 1e-9 is never sampled, yet its log-prob is where bf16 rounding shows most, and a
probe of random tokens would report that noise rather than the gap that skews importance ratios.

Not here: the probe's format in the manifest (`weightsync.format.probe`), comparing an engine's
answer with it (`weightsync.agents.parity`), rounding the trainer's weights to what it publishes
(`trainer/engine.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch

from weightsync.format.probe import Probe, expert_positions_that_fit
from weightsync.models.decoder import CausalLM, token_logprobs

DEFAULT_PROMPTS = 4
DEFAULT_PROMPT_TOKENS = 32
DEFAULT_PROMPT_SEED = 20261127


def default_prompts(
    vocab_size: int,
    *,
    count: int = DEFAULT_PROMPTS,
    length: int = DEFAULT_PROMPT_TOKENS,
    seed: int = DEFAULT_PROMPT_SEED,
) -> list[list[int]]:
    """`count` prompts of `length` token ids in [0, vocab_size), the same for the same arguments."""
    if count < 1 or length < 1 or vocab_size < 1:
        raise ValueError(
            f"probe prompts need count >= 1, length >= 1, vocab_size >= 1; got {count}, {length}, {vocab_size}"
        )
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=generator).tolist()


@dataclasses.dataclass(frozen=True)
class ProbeRun:
    """What a model computed for a probe's prompts."""

    logprobs: list[torch.Tensor]
    """Per prompt: float32 log p(token i | tokens < i) for i = 1..n-1."""
    experts: list[torch.Tensor] | None
    """Per prompt: int64 [tokens, sparse layers, top_k], sorted expert ids; None for dense models."""
    prompts: list[list[int]] | None = None
    """The token ids scored (`run_probe` records what it was given)."""


@torch.no_grad()
def greedy_extend(
    model: CausalLM, prompts: Sequence[Sequence[int]], length: int, *, device: torch.device | None = None
) -> list[list[int]]:
    """`prompts` (all of one length) continued with `model`'s greedy tokens up to `length` tokens,
    all prompts as one batch, the whole prefix each step (no cache: it must run through a sharded
    model as it is). Collective when `model` is sharded: every rank calls it alike."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("greedy_extend continues prompts of one length")
    ids = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=device or _device_of(model, None))
    while ids.shape[1] < length:
        ids = torch.cat([ids, model(ids)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids.tolist()


@torch.no_grad()
def run_probe(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
    recording: Callable[[], contextlib.AbstractContextManager[list[torch.Tensor]]] | None = None,
    device: torch.device | None = None,
) -> ProbeRun:
    """The probe's prompts through `model` (on `weights` instead of its own, if given), one
    forward pass per prompt length. Collective when `model` is sharded: every rank calls it alike.
    `recording`: how a sharded model hands back its router logits (a context that collects them
    in layer order); by default the forward's `router_logits` list. `device`: where the prompts
    go (a sharded model whose shards are offloaded to the CPU computes on its device); by default
    where the weights are."""
    device = device or _device_of(model, weights)
    sparse = model.config.is_moe
    logprobs: list[torch.Tensor | None] = [None] * len(prompts)
    experts: list[torch.Tensor | None] = [None] * len(prompts)
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    for length, group in sorted(by_length.items()):  # one pass per prompt length, in a fixed order
        ids = torch.tensor([list(prompts[i]) for i in group], dtype=torch.long, device=device)
        if recording is not None and sparse:
            with recording() as router_logits:
                logits = model(ids)
        else:
            router_logits = [] if sparse else None
            logits = model(ids, weights=weights, router_logits=router_logits)
        for row, lp in zip(group, token_logprobs(logits[:, :-1], ids[:, 1:]).float().cpu(), strict=True):
            logprobs[row] = lp
        if router_logits:
            k = model.config.num_experts_per_tok
            chosen = [
                logit.reshape(len(group), length, -1).float().topk(k, dim=-1).indices.sort(dim=-1).values
                for logit in router_logits
            ]
            for row, choice in zip(group, torch.stack(chosen, dim=2).cpu(), strict=True):
                experts[row] = choice
    recorded = sparse and all(e is not None for e in experts)
    return ProbeRun(logprobs=logprobs, experts=experts if recorded else None, prompts=[list(p) for p in prompts])


def _device_of(model: CausalLM, weights: Mapping[str, torch.Tensor] | None) -> torch.device:
    if weights:
        return next(iter(weights.values())).device
    for parameter in model.parameters():
        local = getattr(parameter, "_local_tensor", parameter)  # an FSDP2 DTensor's own shard
        if local.device.type != "meta":
            return local.device
    return torch.device("cpu")


def to_probe(prompts: Sequence[Sequence[int]], run: ProbeRun, *, compute_dtype: str = "float32") -> Probe:
    """The manifest's form of a probe run (`weightsync.format.probe.Probe`). Expert choices are
    kept for as many leading positions as fit the probe's size bound."""
    experts = None
    if run.experts is not None:
        every = torch.cat(run.experts).numpy()
        keep = expert_positions_that_fit(prompts, every.shape[1], every.shape[2])
        experts = every[:keep]
    logprobs = torch.cat([lp.reshape(-1) for lp in run.logprobs]).numpy()
    return Probe(prompts=prompts, logprobs=logprobs, compute_dtype=compute_dtype, experts=experts)
