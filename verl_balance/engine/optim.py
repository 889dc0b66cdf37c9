"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from verl_balance.engine.config import EngineConfig


def lr_multiplier(step: int, *, config: EngineConfig) -> float:
    """Factor on config.optim.lr for optimizer step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.optim.lr_scheduler == "constant":
        return 1.0
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    floor = config.optim.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[torch.nn.Parameter], *, config: EngineConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over params plus its LambdaLR schedule."""
    o = config.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config=config))
    return optimizer, scheduler


def apply_optim_config(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, *, config: EngineConfig
) -> None:
    """Make a restored optimizer and schedule follow ``config.optim`` from the next step on.

    Loading a checkpoint restores the saved param-group hyper-parameters and the schedule's base
    learning rate, i.e. the old run's ``optim`` values; the schedule's shape already comes from
    ``config`` (its lambda is not saved). This sets the base rate to ``optim.lr``, the current rate
    to ``optim.lr * lr_multiplier(restored step)`` and AdamW's weight decay, betas and eps, so a
    resume with changed ``optim`` keys uses them (the Adam moments and the step stay restored)."""
    o = config.optim
    rate = o.lr * lr_multiplier(scheduler.last_epoch, config=config)
    for group in optimizer.param_groups:
        group.update(initial_lr=o.lr, lr=rate, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps)
    scheduler.base_lrs = [o.lr] * len(optimizer.param_groups)
    scheduler._last_lr = [rate] * len(optimizer.param_groups)  # what get_last_lr() reports until the next step
