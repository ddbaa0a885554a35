"""guard: decides whether a finished backward pass may become an optimizer step.

A step is bad when its loss or gradient norm is not finite, or when the watched metric (the
loss by default) exceeds `spike_factor` times the median of the last `window` accepted steps
(judged once `min_history` steps were accepted, and only while that median is positive: a
policy-gradient loss hovers around 0 and has no meaningful ratio, watch "loss/nll" there).

States and transitions (`streak` = bad steps in a row):
    accept    -> the value joins the history, streak = 0
    skip      -> the optimizer step is dropped (gradients zeroed), streak += 1
    rollback  -> after `rollback_after` bad steps in a row with action "rollback": the trainer
                 restores the last checkpoint and calls `reset_streak()`
Every rank sees the same globally reduced values, so every rank reaches the same verdict
without talking to the others.

Not here: restoring checkpoints (the trainer and checkpoint.py do that), logging of metrics.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import statistics

from weightsync.trainer.config import GuardConfig


class Verdict(enum.Enum):
    ACCEPT = "accept"
    SKIP = "skip"
    ROLLBACK = "rollback"


@dataclasses.dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str = ""


class SpikeGuard:
    """The running history of accepted values and the current bad-step streak."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.metric = config.watch
        self.history: collections.deque[float] = collections.deque(maxlen=config.window)
        self.streak = 0

    def judge(self, metrics: dict[str, float]) -> Decision:
        """The verdict for a step whose reduced metrics (loss, grad_norm, ...) are given."""
        if not self.config.enabled:
            return Decision(Verdict.ACCEPT)
        reason = self._problem(metrics)
        if not reason:
            self.history.append(float(metrics[self.metric]))
            self.streak = 0
            return Decision(Verdict.ACCEPT)
        self.streak += 1
        if self.config.action == "rollback" and self.streak >= self.config.rollback_after:
            return Decision(Verdict.ROLLBACK, f"{reason}; {self.streak} bad steps in a row")
        return Decision(Verdict.SKIP, reason)

    def _problem(self, metrics: dict[str, float]) -> str:
        for name in ("loss", "grad_norm"):
            value = metrics.get(name)
            if value is not None and not math.isfinite(value):
                return f"non-finite {name} ({value})"
        value = float(metrics[self.metric])
        if not math.isfinite(value):
            return f"non-finite {self.metric} ({value})"
        if len(self.history) >= self.config.min_history:
            median = statistics.median(self.history)
            if median > 0 and value > self.config.spike_factor * median:
                return f"{self.metric} spike: {value:.4g} > {self.config.spike_factor} x median {median:.4g}"
        return ""

    def reset_streak(self) -> None:
        self.streak = 0

    def state_dict(self) -> dict:
        return {"history": list(self.history), "streak": self.streak}

    def load_state_dict(self, state: dict) -> None:
        self.history = collections.deque((float(v) for v in state["history"]), maxlen=self.config.window)
        self.streak = int(state["streak"])
