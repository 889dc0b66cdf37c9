"""RL algorithm pieces: outcome advantages (GRPO, Dr.GRPO, RLOO), PPO-clip policy loss, KL estimators."""

from verl_balance.algorithms.advantages import (
    ADV_ESTIMATORS,
    AdvantageInputError,
    compute_advantages,
    compute_grpo_outcome_advantage,
    group_outcome_advantages,
)
from verl_balance.algorithms.kl import KL_ESTIMATORS, KLEstimatorError, kl_penalty
from verl_balance.algorithms.policy_loss import PolicyLossConfig, PolicyLossConfigError, PPOLoss, ppo_clip_token_loss

__all__ = [
    "ADV_ESTIMATORS",
    "KL_ESTIMATORS",
    "AdvantageInputError",
    "KLEstimatorError",
    "PolicyLossConfig",
    "PolicyLossConfigError",
    "PPOLoss",
    "compute_advantages",
    "compute_grpo_outcome_advantage",
    "group_outcome_advantages",
    "kl_penalty",
    "ppo_clip_token_loss",
]
