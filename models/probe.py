"""probe: a parity probe's prompts, and running them — the trainer's side and the reference
engine's side of the same computation.

Prompts (`draw_prompts`, `check_prompts`): each is `length` token ids drawn without replacement,
so that every position holds another token. A prompt of one token repeated (what a small model's
greedy continuation often is) tests almost nothing: attention returns the same vector however
positions are encoded, and every layer sees one input. Drawn prompts are distinct by
construction, and `check_prompts` refuses degenerate ones wherever prompts come from. For MoE
models the trainer also checks that the prompts make every sparse layer's router choose every
expert at least once (`unrouted_experts`) and repairs the set with further drawn prompts where
they do not (trainer/publish.py), so that a swapped or misrouted expert cannot hide.

Records (`run_probe`): the prompts through the model on given weights, staged — the embedding,
then each decoder layer, then the final norm and the output projection, each computed with
`torch.func.functional_call` on its own tensors only — in one or more compute dtypes at once.
The weights come from a callable, so the trainer hands each tensor in as it is published (a
sharded tensor gathered one at a time: never the whole model at once) and the reference engine
hands in what it serves; both run this very code on the same shapes (the prompts of a length as
one batch, in a fixed order), so where the weights and the dtype are the same the engine matches
the trainer to the last bit. For MoE models it records the experts each sparse layer's router
chose at every position (top-k of the router logits, sorted ids). With `top_k` it also returns
each position's k most likely next tokens.

Training top-k (`run_top_k`): the same prompts through any forward (the trainer's sharded
training model as it trains), each position's k most likely next tokens with their log-probs:
what RL would sample, for the training/inference gap (agents/parity.py).

Not here: the probe's format in the manifest (`weightsync.format.probe`), comparing an engine's
answer with it (`weightsync.agents.parity`), which weights the trainer hands in
(`trainer/engine.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch.func import functional_call

from weightsync.format.probe import Probe, ProbeRecord, TrainingTopK, expert_positions_that_fit
from weightsync.models.decoder import ModelConfig, output_logits, rope_inv_freq, rotary_cos_sin, skeleton
from weightsync.models.moe import SparseMoeBlock

DEFAULT_PROMPTS = 4
DEFAULT_PROMPT_TOKENS = 32
DEFAULT_PROMPT_SEED = 20261127
DEFAULT_TOP_K = 8
MIN_DISTINCT_FRACTION = 0.5
"""A prompt must hold at least this fraction of distinct tokens (of its length, or of the
vocabulary when that is smaller): below it, most positions repeat what others hold."""


class ProbeError(ValueError):
    """Prompts a probe must not be built on (degenerate, or not of the model's vocabulary)."""


def draw_prompts(
    vocab_size: int, *, length: int = DEFAULT_PROMPT_TOKENS, seed: int = DEFAULT_PROMPT_SEED
) -> Iterator[list[int]]:
    """Endless prompts of `length` token ids in [0, vocab_size), each drawn without replacement
    (the vocabulary is reshuffled where `length` exceeds it); the same sequence for the same arguments."""
    if length < 2 or vocab_size < 2:
        raise ValueError(f"probe prompts need length >= 2 and vocab_size >= 2, got {length} and {vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    while True:
        rounds = -(-length // vocab_size)
        yield torch.cat([torch.randperm(vocab_size, generator=generator) for _ in range(rounds)])[:length].tolist()


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """ProbeError unless every prompt has at least 2 tokens, all in the vocabulary, and at least
    MIN_DISTINCT_FRACTION of them distinct."""
    for i, prompt in enumerate(prompts):
        if len(prompt) < 2 or not all(0 <= t < vocab_size for t in prompt):
            raise ProbeError(
                f"probe prompt {i} needs at least 2 token ids in [0, {vocab_size}), got {list(prompt)[:8]}"
            )
        distinct, needed = len(set(prompt)), MIN_DISTINCT_FRACTION * min(len(prompt), vocab_size)
        if distinct < needed:
            raise ProbeError(
                f"probe prompt {i} holds {distinct} distinct tokens in {len(prompt)}: with so many positions "
                "alike, attention cannot tell positions apart and a positional or attention error would not show; "
                "draw prompts with draw_prompts"
            )


@dataclasses.dataclass(frozen=True)
class ProbeRun:
    """What a model computed for a probe's prompts."""

    logprobs: list[torch.Tensor]
    """Per prompt: float32 log p(token i | tokens < i) for i = 1..n-1."""
    experts: list[torch.Tensor] | None = None
    """Per prompt: int64 [tokens, sparse layers, top_k], sorted expert ids; None for dense models."""
    top_ids: list[torch.Tensor] | None = None
    """With top_k: per prompt int64 [n-1, k], each position's most likely next tokens, best first."""
    top_logprobs: list[torch.Tensor] | None = None
    """With top_k: per prompt float32 [n-1, k], their log-probs."""


def _groups(prompts: Sequence[Sequence[int]]) -> list[tuple[int, list[int]]]:
    """Prompt indices by length, shortest first: one forward pass per length, in a fixed order."""
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    return sorted(by_length.items())


@torch.no_grad()
def run_probe(
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    weight: Callable[[str], torch.Tensor],
    *,
    dtypes: Sequence[torch.dtype],
    top_k: int = 0,
    device: torch.device | str = "cpu",
) -> dict[torch.dtype, ProbeRun]:
    """The prompts through the model of `config` on the tensors `weight(name)` returns (HF names),
    cast to each of `dtypes`, staged layer by layer (see the module docstring); each tensor is
    asked for once, in a fixed order (a collective gather, if it is one, runs alike on every rank)."""
    architecture = skeleton(config)  # every tensor comes from `weight`
    groups = _groups(prompts)
    ids = [torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=device) for _, rows in groups]
    inv_freq = rope_inv_freq(config).to(device)  # as CausalLM holds it: computed on the CPU
    embed = weight("model.embed_tokens.weight")
    hidden = {dtype: [] for dtype in dtypes}
    rotary = {}
    for dtype in dtypes:
        table = {"weight": embed.to(dtype)}
        for g, group_ids in enumerate(ids):
            x = functional_call(architecture.model.embed_tokens, table, (group_ids,))
            hidden[dtype].append(x)
            rotary[dtype, g] = rotary_cos_sin(inv_freq, 0, group_ids.shape[1], x.dtype)
    routed: dict[torch.dtype, list[list[torch.Tensor]]] = {dtype: [[] for _ in groups] for dtype in dtypes}
    for i, layer in enumerate(architecture.model.layers):
        tensors = {name: weight(f"model.layers.{i}.{name}") for name in layer.state_dict()}
        sparse = isinstance(layer.mlp, SparseMoeBlock)
        for dtype in dtypes:
            local = {name: t.to(dtype) for name, t in tensors.items()}
            for g in range(len(groups)):
                router: list[torch.Tensor] | None = [] if sparse else None
                cos, sin = rotary[dtype, g]
                hidden[dtype][g] = functional_call(layer, local, (hidden[dtype][g], cos, sin, None, router))
                if router:
                    routed[dtype][g].append(router[0])
    norm = weight("model.norm.weight")
    head = embed if config.tie_word_embeddings else weight("lm_head.weight")
    runs = {}
    for dtype in dtypes:
        logits = [
            output_logits(functional_call(architecture.model.norm, {"weight": norm.to(dtype)}, (x,)), head.to(dtype))
            for x in hidden[dtype]
        ]
        runs[dtype] = _collect(prompts, groups, ids, logits, routed[dtype], top_k, config.num_experts_per_tok)
    return runs


def _collect(
    prompts: Sequence[Sequence[int]],
    groups: list[tuple[int, list[int]]],
    ids: list[torch.Tensor],
    logits: list[torch.Tensor],
    routed: list[list[torch.Tensor]],
    top_k: int,
    experts_per_token: int,
) -> ProbeRun:
    """Per-prompt log-probs (and top-k, expert choices) from each length group's logits (and
    its sparse layers' router logits, in layer order: none for a dense model)."""
    n = len(prompts)
    logprobs: list = [None] * n
    experts: list = [None] * n
    top_ids: list = [None] * n
    top_logprobs: list = [None] * n
    for (length, rows), group_ids, group_logits, router_logits in zip(groups, ids, logits, routed, strict=True):
        logp = torch.log_softmax(group_logits[:, :-1].float(), dim=-1)
        taken = logp.gather(-1, group_ids[:, 1:].unsqueeze(-1)).squeeze(-1).cpu()
        best = logp.topk(top_k, dim=-1) if top_k else None
        chosen = None
        if router_logits:
            chosen = torch.stack(
                [
                    r.reshape(len(rows), length, -1).float().topk(experts_per_token, dim=-1).indices.sort(dim=-1).values
                    for r in router_logits
                ],
                dim=2,
            ).cpu()
        for j, row in enumerate(rows):
            logprobs[row] = taken[j]
            if best is not None:
                top_ids[row], top_logprobs[row] = best.indices[j].cpu(), best.values[j].cpu()
            if chosen is not None:
                experts[row] = chosen[j]
    return ProbeRun(
        logprobs=logprobs,
        experts=experts if all(e is not None for e in experts) else None,
        top_ids=top_ids if top_k else None,
        top_logprobs=top_logprobs if top_k else None,
    )


@torch.no_grad()
def run_top_k(
    forward: Callable[[torch.Tensor], torch.Tensor],
    prompts: Sequence[Sequence[int]],
    top_k: int,
    *,
    device: torch.device | str = "cpu",
) -> ProbeRun:
    """The prompts through `forward` (token ids (batch, tokens) -> logits), one pass per prompt
    length: each position's log-prob of the next prompt token and its `top_k` most likely next tokens."""
    groups = _groups(prompts)
    ids = [torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=device) for _, rows in groups]
    logits = [forward(group_ids) for group_ids in ids]
    return _collect(prompts, groups, ids, logits, [[] for _ in groups], top_k, 0)


def unrouted_experts(config: ModelConfig, run: ProbeRun) -> dict[int, list[int]]:
    """Sparse layer (its index among the sparse layers) -> experts its router chose at no position
    of the run; empty when every sparse layer chose every expert somewhere."""
    if run.experts is None:
        return {}
    chosen = torch.cat(run.experts)  # [positions, sparse layers, top_k]
    missing = {}
    for layer in range(chosen.shape[1]):
        seen = set(chosen[:, layer].unique().tolist())
        gaps = [e for e in range(config.num_experts) if e not in seen]
        if gaps:
            missing[layer] = gaps
    return missing


def cover_experts(
    config: ModelConfig, pool: Sequence[Sequence[int]], run: ProbeRun, *, keep: int, room: int
) -> tuple[list[list[int]], dict[int, list[int]]]:
    """The repair of a MoE probe's prompts: the first `keep` prompts of `pool`, plus up to `room`
    more of it, chosen greedily by the (sparse layer, expert) pairs their positions route to that
    the chosen ones do not (`run`: the pool through the model); and what stays unrouted."""

    def pairs(i: int) -> set[tuple[int, int]]:
        chosen = run.experts[i]  # [tokens, sparse layers, top_k]
        return {(layer, int(e)) for layer in range(chosen.shape[1]) for e in chosen[:, layer].unique()}

    picked = list(range(keep))
    covered = set().union(*(pairs(i) for i in picked))
    candidates = {i: pairs(i) for i in range(keep, len(pool))}
    while len(picked) < keep + room and candidates:
        best = max(candidates, key=lambda i: (len(candidates[i] - covered), -i))
        if not candidates.pop(best) - covered:
            break  # nothing left in the pool reaches what is missing
        picked.append(best)
        covered |= pairs(best)
    missing = unrouted_experts(config, ProbeRun(logprobs=[], experts=[run.experts[i] for i in picked]))
    return [list(pool[i]) for i in picked], missing


def to_probe(
    prompts: Sequence[Sequence[int]],
    records: Mapping[str, ProbeRun],
    *,
    training: ProbeRun | None = None,
    training_dtype: str = "float32",
) -> Probe:
    """The manifest's form of probe runs (`weightsync.format.probe.Probe`): `records` by compute
    dtype name (the first is the default), `training` with top-k ids. Expert choices are kept for
    as many leading positions as fit the probe's size bound."""
    first = next(iter(records.values()))
    keep = None
    if first.experts is not None:
        layers, k = first.experts[0].shape[1:]
        predicted = sum(len(p) - 1 for p in prompts)
        k_training = training.top_ids[0].shape[1] if training is not None else 0
        # base64 of the records' float32 log-probs and the training top-k's uint32 ids and float32 log-probs
        other = (4 * predicted * len(records) + 8 * predicted * k_training) * 4 // 3
        keep = expert_positions_that_fit(prompts, layers, k, records=len(records), other_bytes=other)
    recorded = [
        ProbeRecord(
            compute_dtype=dtype,
            logprobs=torch.cat([lp.reshape(-1) for lp in run.logprobs]).numpy(),
            experts=None if run.experts is None else torch.cat(run.experts).numpy()[:keep],
        )
        for dtype, run in records.items()
    ]
    top = None
    if training is not None:
        top = TrainingTopK(
            compute_dtype=training_dtype,
            ids=torch.cat(training.top_ids).numpy(),
            logprobs=torch.cat(training.top_logprobs).numpy(),
        )
    return Probe(prompts=prompts, records=recorded, training=top)
