"""losses: every loss the training engine minimises, from per-token log-probs.

Two front ends, one set of per-token terms (ratio r_t = exp(logp_t - sampler_logp_t), the PPO
clip, the k3 KL estimator). Every loss is a *sum* over tokens, never a mean: the caller decides
the normalisation (the TOML loop divides by the weight of its whole global batch; the Training
API's callers put it in their weights or advantages).

The TOML loop's losses (`LossConfig.kind`; `compute_loss`), over weighted tokens
(Shao et al. 2024; PPO clipping with separate low/high bounds as in DAPO; dual clipping as in
Ye et al. 2020), per token t of a sequence with advantage A:

    sft   l_t = -logp_t
    grpo  pg_t = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)
          pg_t = min(pg_t, c * |A|)   if A < 0 and c (dual clip) > 0
          kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1    (k3, >= 0, 0 iff equal)
          l_t  = pg_t + beta * kl_t
    loss = sum_t w_t * l_t     (`mean_over_weights` gives one batch's token mean)

The Training API's losses, by the names the Tinker SDK uses (`LOSSES`; `sum_datum_losses`),
per token of one datum, with the datum's named inputs:

    cross_entropy        -w_t * logp_t                                  inputs: target_tokens, weights
    importance_sampling  -r_t * A_t                                     inputs: target_tokens, logprobs, advantages
    ppo                  -min(r_t * A_t, clip(r_t, lo, hi) * A_t)       (+ config clip_low_threshold,
    cispo                -sg(clip(r_t, lo, hi)) * logp_t * A_t           clip_high_threshold: 0.8 / 1.2)

A custom loss (the SDK's `forward_backward_custom`) needs nothing here: the SDK runs the user's
loss on the client and sends its gradient back as cross_entropy weights.

MoE models add the router's load-balancing loss (the Switch loss of `models.moe`) to either
front end's loss, in a form that splits over micro-batches and ranks (`router_load`, then
`load_balancing_share` of each part; the engine sums the expert counts over the ranks between
the two). Over R routed rows (real tokens x MoE layers), N experts, k slots:

    aux = N * sum_e F_e * P_e,    F_e = (top-k picks of e) / R,    P_e = (sum_r p_re) / R

F_e carries no gradient, so aux is a sum over rows of N * sum_e F_e * p_re / R: each part of a
batch contributes its own rows' terms, with the F_e and R of the whole.

Not here: the forward pass and backward (engine.py), checking a request's loss inputs (the
Training API's front end, `weightsync.app.training.wire`), reduction across ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch

from weightsync.trainer.config import LossConfig
from weightsync.trainer.data import DatumBatch, MicroBatch

_MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped here before exp: beyond it the token is clipped anyway, and an
unclamped exp of a corrupt sampler log-prob would turn the loss into inf/NaN."""


@dataclasses.dataclass(frozen=True)
class LossSums:
    """A batch's loss: `loss` (a sum, carrying the graph) and `metrics` (detached sums of
    w_i * value_i, to be divided by the same weight total as the loss). `per_token` holds each
    datum's per-token losses (detached) where the caller hands them back (the Training API)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    per_token: tuple[torch.Tensor, ...] = ()


# ------------------------------------------------------------------------ per-token terms


def importance_ratio(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor) -> torch.Tensor:
    """r = exp(logp - sampler_logp): corrects for the sampler's weights being older than the trainer's."""
    return torch.exp((logprobs - sampler_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def clipped_policy_loss(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """-min(r * A, clip(r, low, high) * A): PPO's pessimistic bound, per token."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(low, high) * advantages
    return -torch.minimum(unclipped, clipped)


# ------------------------------------------------------------------ the TOML loop's losses


def sft_loss(logprobs: torch.Tensor, weights: torch.Tensor) -> LossSums:
    """Token cross-entropy: sum of -w * log p(target)."""
    nll = -(logprobs * weights).sum()
    return LossSums(nll, {"loss/nll": nll.detach()})


def grpo_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float = 0.0,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
) -> LossSums:
    """The clipped importance-weighted policy gradient (see the module docstring).

    logprobs, sampler_logprobs, weights, ref_logprobs: (batch, tokens); advantages: (batch,).
    """
    if kl_coef and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs from the frozen reference model")
    active = weights > 0
    ratio = importance_ratio(logprobs, sampler_logprobs)
    adv = advantages.to(logprobs.dtype)[:, None].expand_as(logprobs)
    pg = clipped_policy_loss(ratio, adv, 1.0 - clip_low, 1.0 + clip_high)
    if dual_clip:
        pg = torch.where(adv < 0, torch.minimum(pg, -dual_clip * adv), pg)
    per_token = pg
    metrics: dict[str, torch.Tensor] = {}
    if kl_coef:
        ref_log_ratio = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0
        per_token = per_token + kl_coef * kl
        metrics["grpo/kl"] = _weighted_sum(kl.detach(), weights, active)
    # Masked positions may hold anything (padding, prompts): keep their inf/NaN out of the sum.
    loss = _weighted_sum(per_token, weights, active)
    with torch.no_grad():
        # Clipping "acts" where it zeroes the token's gradient: ratio above the top for A > 0,
        # below the bottom for A < 0.
        clip_active = ((ratio > 1.0 + clip_high) & (adv > 0)) | ((ratio < 1.0 - clip_low) & (adv < 0))
        metrics.update(
            {
                "grpo/pg": _weighted_sum(pg.detach(), weights, active),
                "grpo/ratio": _weighted_sum(ratio, weights, active),
                "grpo/clip_frac": _weighted_sum(clip_active.to(weights.dtype), weights, active),
                "grpo/sampler_nll": _weighted_sum(-sampler_logprobs, weights, active),
            }
        )
    return LossSums(loss, metrics)


def _weighted_sum(values: torch.Tensor, weights: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    return torch.where(active, values * weights, torch.zeros_like(values)).sum()


def compute_loss(
    config: LossConfig, logprobs: torch.Tensor, batch: MicroBatch, ref_logprobs: torch.Tensor | None = None
) -> LossSums:
    """The configured loss of one micro-batch, as weighted sums.

    The SFT cross-entropy of the same tokens is reported under GRPO too ("loss/nll"): a
    policy whose likelihood of its own samples collapses shows up there first.
    """
    if config.kind == "sft":
        return sft_loss(logprobs, batch.loss_weights)
    if batch.advantages is None or batch.sampler_logprobs is None:
        raise ValueError('loss.kind = "grpo" needs examples with an advantage and sampler_logprobs')
    result = grpo_loss(
        logprobs,
        batch.sampler_logprobs,
        batch.advantages,
        batch.loss_weights,
        clip_low=config.clip_low,
        clip_high=config.clip_high,
        dual_clip=config.dual_clip,
        kl_coef=config.kl_coef,
        ref_logprobs=ref_logprobs,
    )
    nll = -(logprobs.detach() * batch.loss_weights).sum()
    return LossSums(result.loss, {**result.metrics, "loss/nll": nll})


def mean_over_weights(sums: LossSums, weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Token means of one batch: (loss, {metric: value})."""
    total = weights.sum().clamp_min(torch.finfo(weights.dtype).tiny)
    return sums.loss / total, {k: float(v / total) for k, v in sums.metrics.items()}


# -------------------------------------------------------------- the Training API's losses


@dataclasses.dataclass(frozen=True)
class LossSpec:
    required: tuple[str, ...]
    """The datum inputs the loss reads (`target_tokens` is the forward pass's)."""
    config_defaults: Mapping[str, float]
    """The loss_fn_config keys it takes, with their defaults."""
    fn: Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], torch.Tensor]
    """(logprobs (T,), inputs, config) -> per-token loss (T,); the datum's loss is its sum."""


def _cross_entropy(logprobs, inputs, config):
    return -logprobs * inputs["weights"]


def _importance_sampling(logprobs, inputs, config):
    return -importance_ratio(logprobs, inputs["logprobs"]) * inputs["advantages"]


def _ppo(logprobs, inputs, config):
    ratio = importance_ratio(logprobs, inputs["logprobs"])
    return clipped_policy_loss(ratio, inputs["advantages"], config["clip_low_threshold"], config["clip_high_threshold"])


def _cispo(logprobs, inputs, config):
    ratio = importance_ratio(logprobs, inputs["logprobs"])
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return -clipped.detach() * logprobs * inputs["advantages"]


_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens", "weights"), {}, _cross_entropy),
    "importance_sampling": LossSpec(("target_tokens", "logprobs", "advantages"), {}, _importance_sampling),
    "ppo": LossSpec(("target_tokens", "logprobs", "advantages"), _CLIP, _ppo),
    "cispo": LossSpec(("target_tokens", "logprobs", "advantages"), _CLIP, _cispo),
}


def sum_datum_losses(name: str, config: Mapping[str, float], logprobs: torch.Tensor, batch: DatumBatch) -> LossSums:
    """The loss `name` of a batch of datums: the sum of every datum's per-token losses (row i of
    `logprobs` is datum i's, padded). A batch without datums (a rank that got none) has the
    loss 0 times its padding row, so backward still reaches every parameter."""
    spec = LOSSES[name]
    total = logprobs.sum() * 0.0
    per_token = []
    for row, (length, inputs) in enumerate(zip(batch.lengths, batch.inputs, strict=True)):
        losses = spec.fn(logprobs[row, :length], inputs, config)
        total = total + losses.sum()
        per_token.append(losses.detach())
    return LossSums(total, {}, tuple(per_token))


# ------------------------------------------------------------ the MoE router's auxiliary loss


@dataclasses.dataclass(frozen=True)
class RouterLoad:
    """How one batch was routed, over every MoE layer; a row is a (real token, MoE layer) pair."""

    prob_sums: torch.Tensor
    """(experts,) the sum over rows of each expert's router probability (carries the graph)."""
    picks: torch.Tensor
    """(experts,) how many of the rows' top-k slots picked each expert (fp32, no graph)."""
    rows: torch.Tensor
    """() the number of rows (fp32)."""


def router_load(
    router_logits: Sequence[torch.Tensor], token_mask: torch.Tensor, *, num_experts: int, top_k: int
) -> RouterLoad:
    """The routing of a batch: `router_logits` has each MoE layer's (batch * tokens, experts)
    logits (what `CausalLM.forward(..., router_logits=[])` collects), `token_mask` (batch, tokens)
    is False on padding, which the loss ignores (as HF's attention mask does)."""
    if not router_logits:
        raise ValueError("router_load needs the router logits of at least one MoE layer")
    keep = token_mask.reshape(-1).repeat(len(router_logits))
    probs = torch.softmax(torch.cat([t.float() for t in router_logits])[keep], dim=-1)
    with torch.no_grad():
        chosen = torch.topk(probs, top_k, dim=-1).indices.reshape(-1)
        picks = torch.bincount(chosen, minlength=num_experts).float()
    return RouterLoad(probs.sum(dim=0), picks, torch.tensor(float(probs.shape[0]), device=probs.device))


def load_balancing_share(
    load: RouterLoad, picks: torch.Tensor, rows: torch.Tensor, total_rows: torch.Tensor | float
) -> torch.Tensor:
    """This batch's share of the load-balancing loss (see the module docstring): its rows' terms,
    with F_e = picks / rows from the batch it is part of (`picks`, `rows`: summed over the ranks)
    and divided by `total_rows`, the rows of everything the loss is a mean over. One batch on one
    rank with picks = load.picks and rows = total_rows = load.rows: `models.moe.load_balancing_loss`."""
    num_experts = load.prob_sums.shape[0]
    fraction = picks / rows.clamp_min(1.0)
    return num_experts * torch.sum(fraction * load.prob_sums) / torch.as_tensor(total_rows).clamp_min(1.0)
