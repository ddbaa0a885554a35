"""parity_figures: the numbers a parity probe reports, from the trainer's probe and an engine's answer.

Two questions, two kinds of figure (weightsync/format/probe.py says what the trainer records):

Does the engine compute what the trainer computes, at the engine's precision? The engine is held
to the trainer's record of its own compute dtype; d = engine - trainer log-prob of each probe
token (every prompt token after the first):

    dlogprob_p50      the median of |d|: the alarm for an engine that computes something else
                      everywhere by a little (another dtype than it says, an epsilon, a kernel
                      that rounds elsewhere). A healthy engine matches most tokens to within the
                      rounding of one logit; at most half the tokens can move it.
    dlogprob_p90      the 90th percentile of |d|: the alarm for an engine that computes something
                      else on part of the tokens by a lot (positions encoded otherwise, two layers
                      or experts swapped, a dropped norm). Ten percent of the tokens can not move it,
                      so one token whose near-tie flips in bf16 never decides it.
    max_abs_dlogprob  the largest |d|: shown, never an alarm (one token decides it).
    expert_mismatch   MoE, engines that expose routing: the fraction of positions where some
                      sparse layer's top-k expert set differs from the record's.

How far apart are training and inference, as RL sees it? Per predicted position, the trainer's
training forward gave its top-k next tokens; the engine gives its own top-k. RL samples from the
engine, so the figure is KL(engine || training) per position, on the tokens either side ranks in
its top k plus one bucket for the rest of the vocabulary (coarse-graining never increases a KL:
with exact values this is a lower bound of the full KL). A token one side does not rank gets that
side's k-th log-prob, the most it can have.

    gap_kl            the mean of the per-position KLs with the largest 10 % left out (no single
                      position decides it): a figure, an alarm only where [agent.parity]
                      max_gap_kl is set
    gap_overlap       the mean fraction of the trainer's top-k tokens the engine also ranks in its top k

Not here: what a breach does, thresholds and reports (`parity.py`), the probe's format
(`weightsync.format.probe`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from weightsync.errors import FormatError
from weightsync.format.probe import Probe, TrainingTopK

GAP_TRIM = 0.1
"""The share of positions with the largest KL that gap_kl leaves out."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Figures:
    """What one engine answer shows against one probe (module docstring)."""

    compute_dtype: str
    """The record the engine was held to: the dtype it computes in."""
    tokens: int
    dlogprob_p50: float | None = None
    """None: the probe has no record of `compute_dtype` (nothing compared)."""
    dlogprob_p90: float | None = None
    max_abs_dlogprob: float | None = None
    expert_mismatch: float | None = None
    expert_positions: int | None = None
    """The positions expert_mismatch is a fraction of: every position whose routing was recorded."""
    gap_kl: float | None = None
    gap_overlap: float | None = None

    @property
    def recorded(self) -> bool:
        return self.dlogprob_p50 is not None


def compare(
    probe: Probe,
    compute_dtype: str,
    logprobs: Sequence[Any],
    experts: Sequence[Any] | None = None,
    top_ids: Sequence[Any] | None = None,
    top_logprobs: Sequence[Any] | None = None,
) -> Figures:
    """The figures of an engine's answer (per prompt: log-probs of tokens 1..n-1, expert choices,
    top-k ids and log-probs) against `probe`, the engine held to its `compute_dtype` record;
    FormatError when the answer does not fit the prompts."""
    ours = probe.split(np.zeros(probe.predicted))
    if len(logprobs) != len(ours):
        raise FormatError(f"the engine answered {len(logprobs)} prompts of the probe's {len(ours)}")
    theirs = []
    for i, (answer, mine) in enumerate(zip(logprobs, ours, strict=True)):
        answer = np.asarray(_numpy(answer), dtype=np.float64).reshape(-1)
        if answer.size != mine.size:
            raise FormatError(f"the engine answered {answer.size} log-probs for probe prompt {i}, not {mine.size}")
        theirs.append(answer)
    engine = np.concatenate(theirs)
    gap_kl, gap_overlap = _gap(probe, top_ids, top_logprobs)
    record = probe.record(compute_dtype)
    if record is None:
        return Figures(compute_dtype=compute_dtype, tokens=int(engine.size), gap_kl=gap_kl, gap_overlap=gap_overlap)
    d = np.abs(engine - record.logprobs.astype(np.float64))
    if not np.isfinite(d).all():
        p50 = p90 = top = math.inf
    else:
        p50, p90 = (float(q) for q in np.quantile(d, [0.5, 0.9], method="lower")) if d.size else (0.0, 0.0)
        top = float(d.max(initial=0.0))
    mismatch = _mismatch(record.experts, experts)
    return Figures(
        compute_dtype=compute_dtype,
        tokens=int(d.size),
        dlogprob_p50=p50,
        dlogprob_p90=p90,
        max_abs_dlogprob=top,
        expert_mismatch=mismatch,
        expert_positions=None if mismatch is None else int(record.experts.shape[0]),
        gap_kl=gap_kl,
        gap_overlap=gap_overlap,
    )


def _mismatch(recorded: np.ndarray | None, experts: Sequence[Any] | None) -> float | None:
    """The fraction of the record's expert-recorded positions where any layer's expert set differs."""
    if recorded is None or experts is None:
        return None
    theirs = np.concatenate([np.asarray(_numpy(e)).reshape(-1, *recorded.shape[1:]) for e in experts])
    covered = recorded.shape[0]
    if theirs.shape[0] < covered or theirs.shape[1:] != recorded.shape[1:]:
        raise FormatError(f"the engine's expert choices have shape {theirs.shape}, the probe's {recorded.shape}")
    if covered == 0:
        return None
    differs = (np.sort(theirs[:covered], axis=-1) != recorded).any(axis=(1, 2))
    return float(differs.mean())


def _gap(
    probe: Probe, top_ids: Sequence[Any] | None, top_logprobs: Sequence[Any] | None
) -> tuple[float | None, float | None]:
    if probe.training is None or top_ids is None or top_logprobs is None:
        return None, None
    ids = np.concatenate([np.asarray(_numpy(t), dtype=np.int64).reshape(-1, probe.training.k) for t in top_ids])
    values = np.concatenate(
        [np.asarray(_numpy(t), dtype=np.float64).reshape(-1, probe.training.k) for t in top_logprobs]
    )
    if ids.shape != probe.training.ids.shape or values.shape != ids.shape:
        raise FormatError(f"the engine's top-k answer has shape {ids.shape}, the probe's {probe.training.ids.shape}")
    kl, overlap = gap_per_position(probe.training, ids, values)
    return trimmed_mean(kl, GAP_TRIM), float(overlap.mean()) if overlap.size else None


def gap_per_position(training: TrainingTopK, ids: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(KL(engine || training) per position, the fraction of the trainer's top k the engine also
    ranks) from the engine's top-k `ids` and `logprobs` [positions, k] (module docstring)."""
    positions = ids.shape[0]
    kl, overlap = np.zeros(positions), np.zeros(positions)
    for i in range(positions):
        mine = dict(zip(training.ids[i].tolist(), training.logprobs[i].astype(np.float64).tolist(), strict=True))
        theirs = dict(zip(ids[i].tolist(), logprobs[i].tolist(), strict=True))
        floor_p, floor_q = min(mine.values()), min(theirs.values())
        union = mine.keys() | theirs.keys()
        log_p = np.array([mine.get(t, floor_p) for t in union])
        log_q = np.array([theirs.get(t, floor_q) for t in union])
        if not np.isfinite(log_q).all():
            kl[i] = math.inf
            continue
        q = np.exp(log_q)
        rest_q, rest_p = max(0.0, 1.0 - q.sum()), max(0.0, 1.0 - np.exp(log_p).sum())
        value = float(np.sum(q * (log_q - log_p)))
        if rest_q > 0:
            value += rest_q * (math.log(rest_q) - math.log(max(rest_p, 1e-12)))
        kl[i] = max(0.0, value)
        overlap[i] = len(mine.keys() & theirs.keys()) / len(mine)
    return kl, overlap


def trimmed_mean(values: np.ndarray, trim: float) -> float | None:
    """The mean of `values` without the largest `trim` share of them (None when there are none)."""
    if not values.size:
        return None
    keep = np.sort(values)[: max(1, values.size - int(trim * values.size))]
    return float(keep.mean())


def _numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        return value.detach().float().cpu().numpy() if value.is_floating_point() else value.detach().cpu().numpy()
    return np.asarray(value)
