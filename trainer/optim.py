"""optim: the AdamW optimizer over the sharded parameters and the learning-rate schedule.

The schedule is a pure function of the step (`lr_at`), so it carries no state of its own: a
resumed or rolled-back run gets the right learning rate from its step alone.

Not here: gradient clipping and the skip decision (the trainer and guard.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from weightsync.trainer.config import OptimizerConfig, ScheduleConfig


def build_optimizer(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW on the fp32 master shards (DTensors); foreach keeps it a few kernels per step."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, foreach=True
    )


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


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
