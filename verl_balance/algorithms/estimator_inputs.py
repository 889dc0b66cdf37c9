"""What an advantage estimator receives: the batch's tensors and verl's ``algorithm.*`` settings.

Every per-token tensor is (B, L) over whole rows; ``response_mask`` is 1 exactly on the loss's
response tokens, so values on response tokens equal verl's on its slices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

from verl_balance.algorithms.advantages import AdvantageOutput

__all__ = ["AdvantageInputs", "AdvantageKeys", "AdvantageOutput", "AdvantageParams"]


@dataclass(frozen=True)
class AdvantageInputs:
    """The batch columns an estimator may read (optional ones: ``ADV_ESTIMATOR_REGISTRY[name].inputs``)."""

    token_level_rewards: torch.Tensor
    """(B, L) per-token reward (score on the last response token, minus any in-reward KL penalty)."""
    response_mask: torch.Tensor
    """(B, L): 1 on the response tokens the loss trains on."""
    index: Any = None
    """(B,) group labels: the prompt uid of each response (verl's ``uid``)."""
    values: torch.Tensor | None = None
    """(B, L): the critic's value of the state before each token (gae)."""
    old_log_probs: torch.Tensor | None = None
    """(B, L): log-prob of each token under the policy that sampled it (the optimal-token baselines)."""
    sum_pi_squared: torch.Tensor | None = None
    """(B, L): sum over the vocabulary of pi(v)^2 at each token (verl's ``actor.calculate_sum_pi_squared``)."""
    rollout_is_weights: torch.Tensor | None = None
    """(B, L): rollout-correction importance weights, optional for the optimal-token baselines."""
    reward_baselines: torch.Tensor | None = None
    """(B,): the reward of the greedy response to the same prompt (remax)."""
    reward_components: Mapping[str, torch.Tensor] | None = None
    """name -> (B,) score: the reward function's separate components (gdpo with ``gdpo_reward_keys``)."""

    def available(self) -> frozenset[str]:
        """Names of the fields that are set."""
        return frozenset(f.name for f in fields(self) if getattr(self, f.name) is not None)


@dataclass
class AdvantageKeys:
    """verl's ``algorithm.*`` keys the estimators read, with verl's defaults."""

    gamma: float = 1.0
    """Discount factor (gae, reinforce_plus_plus), in [0, 1]."""
    lam: float = 1.0
    """GAE lambda (adv_estimator=gae), in [0, 1]: 1 = Monte-Carlo returns, 0 = one-step TD."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide the group-relative advantages by the group's std (grpo, grpo_vectorized, grpo_passk, gdpo);
    false = Dr.GRPO."""
    gdpo_reward_keys: Optional[list] = None
    """gdpo: the reward function's extra fields to normalise separately (null = the summed reward alone)."""
    gdpo_reward_weights: Optional[list] = None
    """gdpo: one weight per gdpo_reward_keys entry (null = all 1)."""


@dataclass
class AdvantageParams(AdvantageKeys):
    """What the estimators read: ``AdvantageKeys`` plus the constants no verl config key sets."""

    epsilon: float = 1e-6
    """Added to the group std (verl's estimator default)."""
    otb_handle_zero_tail: bool = True
    """Optimal-token baselines: none past the second-longest response of a group (verl's ``handle_zero_tail``)."""
    otb_epsilon: float = 1e-8
    """Optimal-token baselines: added to the baseline's denominator."""
