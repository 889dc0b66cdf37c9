"""DAPO's overlong reward shaping (verl's ``dapo`` reward manager, ``reward_kwargs.overlong_buffer_cfg``).

Invariant (verl's ``DAPORewardManager``): with buffer length b, penalty factor f and max_resp_len M,
a response of length l scores score + min(-(l - (M - b)) / b * f, 0), applied to every score the
reward function returns (training and validation); ``log`` adds ``overlong_reward`` and ``overlong``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

REWARD_MANAGERS = ("naive", "dapo")


@dataclass
class OverlongBufferConfig:
    """verl's ``reward_kwargs.overlong_buffer_cfg`` (read with ``reward_manager=dapo``)."""

    enable: bool = False
    """Penalise responses longer than max_resp_len - len."""
    len: int = 0
    """The buffer: the last ``len`` tokens before max_resp_len where the penalty grows."""
    penalty_factor: float = 1.0
    """The penalty at max_resp_len tokens."""
    log: bool = False
    """Add ``overlong_reward`` and ``overlong`` to the reward's logged extras."""

    def __post_init__(self) -> None:
        if self.enable and not self.len > 0:
            raise ValueError(f"len={self.len} must be > 0 with enable=true (to disable the penalty set enable=false)")
        if not self.penalty_factor >= 0:
            raise ValueError(f"penalty_factor={self.penalty_factor} must be >= 0")


def overlong_penalty(response_lengths, *, max_resp_len: int, config: OverlongBufferConfig) -> np.ndarray:
    """(B,) float64: min(-(l - (max_resp_len - len)) / len * penalty_factor, 0) per response."""
    if max_resp_len < config.len:
        raise ValueError(f"max_resp_len={max_resp_len} must be >= overlong_buffer len={config.len}")
    exceed = np.asarray(response_lengths, dtype=np.float64) - (max_resp_len - config.len)
    return np.minimum(-exceed / config.len * config.penalty_factor, 0.0)


def shape_scores(
    scores: np.ndarray,
    extras: Mapping[str, np.ndarray],
    *,
    response_lengths,
    max_resp_len: int,
    config: OverlongBufferConfig,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(scores + the overlong penalty, extras with the penalty logged when ``config.log``); unchanged
    when the buffer is off."""
    extras = dict(extras)
    if not config.enable:
        return scores, extras
    penalty = overlong_penalty(response_lengths, max_resp_len=max_resp_len, config=config)
    if config.log:
        extras["overlong_reward"] = penalty
        extras["overlong"] = (penalty < 0).astype(np.float64)
    return np.asarray(scores, dtype=np.float64) + penalty, extras


__all__ = ["REWARD_MANAGERS", "OverlongBufferConfig", "overlong_penalty", "shape_scores"]
