"""losses: SFT cross-entropy and a GRPO-style clipped policy gradient, over weighted tokens.

Every loss here returns *sums over weighted tokens* (sum_i w_i * l_i), never means: the trainer
divides by the weight of the whole global batch (all ranks, all micro-batches), so a token
counts the same whatever the number of ranks or micro-batches. `mean_over_weights` gives the
token mean of one batch (what the unit tests and single-batch callers want).

GRPO-style loss, per token t of a sequence with advantage A (Shao et al. 2024; PPO clipping
with separate low/high bounds as in DAPO; dual clipping as in Ye et al. 2020):

    r_t   = exp(logp_t - logp_sampler_t)          importance ratio: corrects for the sampler's
                                                  weights being older than the trainer's
    pg_t  = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)
    pg_t  = min(pg_t, c * |A|)   if A < 0 and c (dual clip) > 0
    kl_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1    (k3 estimator, >= 0, 0 iff equal)
    l_t   = pg_t + beta * kl_t

Not here: the forward pass, batching, reduction across ranks.
"""

from __future__ import annotations

import dataclasses

import torch

from weightsync.trainer.config import LossConfig
from weightsync.trainer.data import MicroBatch

_MAX_LOG_RATIO = 20.0
"""Log-ratios are clamped here before exp: beyond it the token is clipped anyway, and an
unclamped exp of a corrupt sampler log-prob would turn the loss into inf/NaN."""


@dataclasses.dataclass(frozen=True)
class LossSums:
    """A micro-batch's weighted sums: `loss` carries the graph; `metrics` are detached sums
    of w_i * value_i, to be divided by the same weight total as the loss."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


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
    log_ratio = (logprobs - sampler_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logprobs.dtype)[:, None].expand_as(logprobs)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * adv
    pg = -torch.minimum(unclipped, clipped)
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
