"""optim: the AdamW optimizer over the sharded parameters, its hyper-parameters, and the
learning-rate schedule.

Hyper-parameters are set on every step (`AdamWParams`): the TOML loop's come from its config
and schedule, the Training API's from each optim_step request, so the optimizer carries none
that matter between steps. The schedule is a pure function of the step (`lr_at`), so it
carries no state of its own: a resumed or rolled-back run gets the right learning rate from its
step alone.

Not here: gradient clipping and the step itself (engine.py), the skip decision (guard.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from weightsync.trainer.config import OptimizerConfig, ScheduleConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamWParams:
    """The hyper-parameters of one AdamW step (decoupled weight decay)."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0

    @classmethod
    def from_config(cls, config: OptimizerConfig, *, lr: float) -> AdamWParams:
        """The TOML loop's: its optimizer config, at the schedule's learning rate."""
        return cls(lr=lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay)


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW on the trainable fp32 master shards (DTensors); foreach keeps it a few kernels per
    step. Its hyper-parameters are placeholders until a step sets them (`set_hyperparameters`)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.0, foreach=True)


def set_hyperparameters(optimizer: torch.optim.Optimizer, params: AdamWParams) -> None:
    for group in optimizer.param_groups:
        group.update(lr=params.lr, betas=params.betas, eps=params.eps, weight_decay=params.weight_decay)


def lr_at(step: int, *, peak_lr: float, schedule: ScheduleConfig, total_steps: int) -> float:
    """Learning rate of optimizer step `step` (1-based): linear warm-up over warmup_steps
    (reaching peak_lr at step warmup_steps), then constant, linear or cosine decay that reaches
    min_lr_ratio * peak_lr at total_steps."""
    if step < 1:
        raise ValueError(f"steps are numbered from 1, got {step}")
    warmup = schedule.warmup_steps
    if step <= warmup:
        return peak_lr * step / warmup
    if schedule.decay == "constant" or total_steps <= warmup:
        return peak_lr
    progress = min(1.0, (step - warmup) / (total_steps - warmup))
    floor = schedule.min_lr_ratio
    if schedule.decay == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak_lr * (floor + (1.0 - floor) * factor)
