"""Advantage estimators: outcome-reward group baselines (GRPO, Dr.GRPO, RLOO; one scalar score per
response) and GAE with a learned critic (PPO).

Invariants:
- ``scores[i]`` is response i's scalar reward; ``index[i]`` its group, rows in any order.
- Output is (B, L) ``advantages[i, t] = a_i * loss_mask[i, t]``: 0 on prompt and padding.
- grpo: a_i = (r_i - mean_g) / (std_g + epsilon), std unbiased; ``norm_adv_by_std_in_grpo=False``:
  a_i = r_i - mean_g (Dr.GRPO). rloo: a_i = r_i - mean of the group's others.
- A group of one has advantage 0 (verl: a_i = r_i).
- gae: verl's ``compute_gae_advantage_return`` on full rows; advantages and returns 0 outside the
  response mask (unlike verl).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from verl_balance.algorithms.group_stats import AdvantageInputError, group_ids, masked_whiten

OUTCOME_ESTIMATORS = ("grpo", "drgrpo", "rloo")
"""Estimators that compare the responses to one prompt (no critic)."""
ADV_ESTIMATORS = (*OUTCOME_ESTIMATORS, "gae")
"""Every estimator ``compute_advantages`` accepts; gae needs the critic's values."""


def validated_scores(scores) -> torch.Tensor:
    """``scores`` as a 1-D tensor, or an error naming the rows whose score is not finite."""
    scores = torch.as_tensor(scores)
    if scores.dim() != 1:
        raise AdvantageInputError(f"scores must be 1-D (one scalar per response), got shape {tuple(scores.shape)}")
    bad = (~torch.isfinite(scores.double())).nonzero().flatten()
    if len(bad):
        raise AdvantageInputError(f"scores of samples {bad[:8].tolist()} are not finite: {scores[bad[:8]].tolist()}")
    return scores


def group_outcome_advantages(
    *,
    scores,
    index,
    estimator: str = "grpo",
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Per-response scalar advantages (B,) float32 from per-response scores and group labels."""
    if estimator not in OUTCOME_ESTIMATORS:
        raise AdvantageInputError(
            f"adv_estimator={estimator!r} is not a group estimator; valid: {list(OUTCOME_ESTIMATORS)}"
        )
    scores = validated_scores(scores)
    device = scores.device
    values = scores.detach().to("cpu", torch.float64)
    group, num_groups = group_ids(index, len(values))

    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, torch.ones_like(values))
    total = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, values)
    mean = total / count
    centered = values - mean[group]
    n = count[group]
    singleton = n < 2

    if estimator == "rloo":
        adv = centered * n / (n - 1).clamp(min=1)
    elif estimator == "drgrpo" or not norm_adv_by_std_in_grpo:
        adv = centered
    else:
        sq = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group, centered.square())
        std = (sq / (count - 1).clamp(min=1)).sqrt()
        adv = centered / (std[group] + epsilon)
    adv = torch.where(singleton, torch.zeros_like(adv), adv)
    return adv.to(device=device, dtype=torch.float32)


def last_token_rewards(*, scores, response_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) float32 ``token_level_rewards``: ``scores[i]`` on row i's last response token, 0 elsewhere."""
    scores = validated_scores(scores)
    if scores.shape[0] != response_mask.shape[0]:
        raise AdvantageInputError(
            f"{scores.shape[0]} scores but the response mask has {response_mask.shape[0]} rows; need one score per row"
        )
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(dim=1).values
    rewards = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = (last >= 0).nonzero().flatten()
    rewards[rows, last[rows]] = scores.to(device=mask.device, dtype=torch.float32)[rows]
    return rewards


def compute_gae(
    *, token_level_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), (B, L) float32, as verl's ``compute_gae_advantage_return``; 0 off the response."""
    if not (token_level_rewards.shape == values.shape == response_mask.shape and values.dim() == 2):
        raise AdvantageInputError(
            f"token_level_rewards {tuple(token_level_rewards.shape)}, values {tuple(values.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must be the same (B, L)"
        )
    bad = (~torch.isfinite(values)).nonzero()
    if len(bad):
        raise AdvantageInputError(f"values are not finite at (row, token) {bad[:4].tolist()}")
    mask = response_mask.to(torch.float32)
    rewards, values = token_level_rewards.to(torch.float32), values.to(torch.float32)
    with torch.no_grad():
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        reversed_advantages = []
        for t in reversed(range(values.shape[1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            # A masked (prompt or padding) token passes the next valid token's value and advantage on.
            next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
            last_gae = gae * mask[:, t] + (1 - mask[:, t]) * last_gae
            reversed_advantages.append(last_gae)
        advantages = torch.stack(reversed_advantages[::-1], dim=1)
        returns = advantages + values
        advantages = masked_whiten(advantages, mask)
    return advantages * mask, returns * mask


class AdvantageOutput(NamedTuple):
    """What ``compute_advantages`` returns: token-aligned (B, L) float32 tensors."""

    advantages: torch.Tensor
    """0 on prompt and padding tokens."""
    returns: torch.Tensor | None
    """The critic's regression targets (gae); None from ``compute_advantages``'s outcome estimators."""


def compute_grpo_outcome_advantage(
    *,
    scores,
    index: np.ndarray | Sequence | torch.Tensor,
    loss_mask: torch.Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO (or Dr.GRPO when ``norm_adv_by_std_in_grpo=False``) advantages, token-aligned (B, L)."""
    return compute_advantages(
        adv_estimator="grpo",
        scores=scores,
        index=index,
        loss_mask=loss_mask,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
    ).advantages


def compute_advantages(
    *,
    adv_estimator: str,
    scores,
    index: np.ndarray | Sequence | torch.Tensor,
    loss_mask: torch.Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> AdvantageOutput:
    """(B, L) float32 advantages of an estimator in ADV_ESTIMATORS (gae: from ``values``, with returns)."""
    if loss_mask.dim() != 2:
        raise AdvantageInputError(f"loss_mask must be (B, L), got shape {tuple(loss_mask.shape)}")
    if adv_estimator == "gae":
        if values is None:
            raise AdvantageInputError("adv_estimator='gae' needs the critic's values (values=None)")
        rewards = last_token_rewards(scores=scores, response_mask=loss_mask)
        advantages, returns = compute_gae(
            token_level_rewards=rewards, values=values, response_mask=loss_mask, gamma=gamma, lam=lam
        )
        return AdvantageOutput(advantages=advantages, returns=returns)
    per_response = group_outcome_advantages(
        scores=scores,
        index=index,
        estimator=adv_estimator,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        epsilon=epsilon,
    )
    if per_response.shape[0] != loss_mask.shape[0]:
        raise AdvantageInputError(
            f"{per_response.shape[0]} scores but loss_mask has {loss_mask.shape[0]} rows; need one score per row"
        )
    advantages = per_response.to(loss_mask.device)[:, None] * loss_mask.to(torch.float32)
    return AdvantageOutput(advantages=advantages, returns=None)
