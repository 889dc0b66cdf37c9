"""RL algorithm pieces: advantages (GRPO, Dr.GRPO, RLOO, GAE), PPO-clip policy loss, KL estimators."""

from verl_balance.algorithms.advantages import (
    ADV_ESTIMATORS,
    OUTCOME_ESTIMATORS,
    AdvantageInputError,
    AdvantageOutput,
    compute_advantages,
    compute_gae,
    compute_grpo_outcome_advantage,
    group_outcome_advantages,
    last_token_rewards,
)
from verl_balance.algorithms.estimator_inputs import AdvantageInputs, AdvantageParams
from verl_balance.algorithms.estimators import ADV_ESTIMATOR_REGISTRY, check_estimator, compute_advantage
from verl_balance.algorithms.kl import KL_ESTIMATORS, KLEstimatorError, kl_penalty
from verl_balance.algorithms.loss_modes import (
    LOSS_MODE_REGISTRY,
    LossModeConfig,
    policy_token_loss,
    required_reductions,
)
from verl_balance.algorithms.loss_reductions import reference_reductions
from verl_balance.algorithms.policy_loss import PolicyLossConfig, PolicyLossConfigError, PPOLoss, ppo_clip_token_loss

__all__ = [
    "ADV_ESTIMATORS",
    "ADV_ESTIMATOR_REGISTRY",
    "LOSS_MODE_REGISTRY",
    "AdvantageInputs",
    "AdvantageParams",
    "LossModeConfig",
    "check_estimator",
    "compute_advantage",
    "policy_token_loss",
    "reference_reductions",
    "required_reductions",
    "KL_ESTIMATORS",
    "OUTCOME_ESTIMATORS",
    "AdvantageOutput",
    "AdvantageInputError",
    "KLEstimatorError",
    "PolicyLossConfig",
    "PolicyLossConfigError",
    "PPOLoss",
    "compute_advantages",
    "compute_gae",
    "compute_grpo_outcome_advantage",
    "group_outcome_advantages",
    "kl_penalty",
    "last_token_rewards",
    "ppo_clip_token_loss",
]
