"""AdamW and the learning-rate schedule (linear warmup, then constant or cosine)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from verl_balance.engine.config import EngineConfig


def lr_multiplier(step: int, *, config: EngineConfig) -> float:
    """Factor on config.lr for optimizer step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter], *, config: EngineConfig
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over params plus its LambdaLR schedule."""
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, eps=config.eps,
                                  weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, config=config))
    return optimizer, scheduler
