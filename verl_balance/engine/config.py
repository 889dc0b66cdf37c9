"""EngineConfig: optimizer, schedule, precision and loss settings of one TrainEngine."""

from __future__ import annotations

from dataclasses import dataclass

from verl_balance.loss import check_agg_mode, check_bug
from verl_balance.models.attention import ATTN_IMPLS

LR_SCHEDULES = ("constant", "cosine")
PARAM_DTYPES = ("float32", "bfloat16")


class EngineConfigError(ValueError):
    """A bad engine configuration value."""


@dataclass
class EngineConfig:
    """Settings of TrainEngine (names follow verl where the concept is the same)."""

    lr: float = 1e-5
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    warmup_steps: int = 0
    lr_schedule: str = "constant"
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    param_dtype: str = "float32"
    attn_impl: str = "auto"
    seed: int = 0
    reshard_after_forward: bool = True
    inject_bug: str | None = None  # parity negative controls only (verl_balance.loss.KNOWN_BUGS)

    def __post_init__(self) -> None:
        check_agg_mode(self.loss_agg_mode)
        check_bug(self.inject_bug)
        if self.lr_schedule not in LR_SCHEDULES:
            raise EngineConfigError(f"lr_schedule={self.lr_schedule!r}; valid: {LR_SCHEDULES}")
        if self.lr_schedule == "cosine" and not self.total_steps:
            raise EngineConfigError("lr_schedule='cosine' needs total_steps > 0")
        if self.param_dtype not in PARAM_DTYPES:
            raise EngineConfigError(f"param_dtype={self.param_dtype!r}; valid: {PARAM_DTYPES}")
        if self.attn_impl not in ATTN_IMPLS:
            raise EngineConfigError(f"attn_impl={self.attn_impl!r}; valid: {ATTN_IMPLS}")
        if self.warmup_steps < 0:
            raise EngineConfigError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise EngineConfigError(f"grad_clip={self.grad_clip} must be > 0 or None")
        if (self.loss_agg_mode == "seq-mean-token-sum-norm"
                and not (self.loss_scale_factor and self.loss_scale_factor > 0)):
            raise EngineConfigError("loss_agg_mode='seq-mean-token-sum-norm' needs "
                                    "loss_scale_factor > 0 (the constant C)")
