"""The driver's advantage step: the batch's columns -> ``algorithms.compute_advantage`` of ``algorithm.adv_estimator``.

Invariants:
- The estimator sees verl's inputs on our layout (rows = prompt + response, right-padded):
  ``token_level_rewards`` = each response's score on its last loss-mask token, ``response_mask`` =
  the loss mask, ``index`` = the prompt of each row (verl's ``uid``), plus ``values``,
  ``reward_baselines``, ``reward_components``, ``old_log_probs``, ``sum_pi_squared`` and
  ``rollout_is_weights`` when the batch has them.
- With ``use_kl_in_reward`` the rewards are the scores minus beta x KL(old || ref) per token; the
  rollout correction then zeroes rejected tokens of the loss mask (verl's modified response mask).
- Pure driver code: no Ray, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from verl_balance.algorithms import AdvantageInputs, AdvantageOutput, compute_advantage, last_token_rewards
from verl_balance.algorithms.estimators import ESTIMATOR_KEY
from verl_balance.algorithms.group_stats import AdvantageInputError
from verl_balance.algorithms.kl_in_reward import KLController, apply_kl_in_reward
from verl_balance.algorithms.rollout_correction import decoupled_correction
from verl_balance.batch_keys import (
    LOSS_MASK_KEY,
    OLD_LOG_PROBS_KEY,
    PROMPT_INDEX_KEY,
    REF_LOG_PROB_KEY,
    ROLLOUT_IS_WEIGHTS_KEY,
    ROLLOUT_LOG_PROBS_KEY,
    SUM_PI_SQUARED_KEY,
    VALUES_KEY,
)
from verl_balance.protocol import Batch
from verl_balance.trainer.config.algorithm import AlgorithmSection


def prompt_baselines(*, baseline_prompt_index, baseline_scores: np.ndarray, row_prompt_index) -> torch.Tensor:
    """(B,) float64: the greedy baseline's score of each row's prompt (one baseline response per prompt)."""
    prompts = np.asarray(baseline_prompt_index, dtype=np.int64)
    if len(np.unique(prompts)) != len(prompts):
        raise AdvantageInputError(f"{ESTIMATOR_KEY}=remax needs one greedy baseline response per prompt")
    by_prompt = dict(zip(prompts.tolist(), np.asarray(baseline_scores, dtype=np.float64).tolist()))
    rows = np.asarray(row_prompt_index, dtype=np.int64).tolist()
    missing = sorted(set(rows) - set(by_prompt))
    if missing:
        raise AdvantageInputError(f"{ESTIMATOR_KEY}=remax: no greedy baseline for prompts {missing[:8]}")
    return torch.tensor([by_prompt[p] for p in rows], dtype=torch.float64)


def reward_components(extras: Mapping[str, np.ndarray], keys) -> dict[str, torch.Tensor]:
    """gdpo's named reward components from the reward function's extra fields, or an error naming the key."""
    missing = [k for k in keys if k not in extras]
    if missing:
        raise AdvantageInputError(
            f"algorithm.gdpo_reward_keys={list(keys)}: the reward function returned no {missing} "
            f"(its extra fields: {sorted(extras)}); return them from compute_score's dict"
        )
    return {k: torch.as_tensor(np.asarray(extras[k], dtype=np.float64)) for k in keys}


def token_level_rewards(
    batch: Batch, *, scores: np.ndarray, algorithm: AlgorithmSection, kl_controller: KLController | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, L) rewards: each score on its row's last loss-mask token; with ``use_kl_in_reward`` minus
    beta x KL(old_log_probs || ref_log_prob) per token (``kl_controller`` is updated, as in verl)."""
    loss_mask = batch[LOSS_MASK_KEY]
    rewards = last_token_rewards(scores=torch.from_numpy(np.asarray(scores)), response_mask=loss_mask)
    if not algorithm.use_kl_in_reward:
        return rewards, {}
    missing = [k for k in (OLD_LOG_PROBS_KEY, REF_LOG_PROB_KEY) if k not in batch]
    assert not missing and kl_controller is not None, f"use_kl_in_reward without {missing} or a controller"
    return apply_kl_in_reward(
        token_level_scores=rewards,
        old_log_probs=batch[OLD_LOG_PROBS_KEY],
        ref_log_probs=batch[REF_LOG_PROB_KEY],
        response_mask=loss_mask,
        controller=kl_controller,
        kl_type=algorithm.kl_penalty,
    )


def correct_rollout(batch: Batch, *, algorithm: AlgorithmSection) -> dict[str, float]:
    """verl's decoupled rollout correction, in place (``rollout_is_weights``; rejected tokens out of the
    loss mask); its metrics. Nothing when off or in bypass mode."""
    if not algorithm.corrects_rollout:
        return {}
    if ROLLOUT_LOG_PROBS_KEY not in batch:
        raise AdvantageInputError(
            "algorithm.rollout_correction needs the rollout's log-probs, which this rollout did not record"
        )
    weights, mask, metrics = decoupled_correction(
        old_log_probs=batch[OLD_LOG_PROBS_KEY],
        rollout_log_probs=batch[ROLLOUT_LOG_PROBS_KEY],
        loss_mask=batch[LOSS_MASK_KEY],
        config=algorithm.rollout_correction,
    )
    batch[LOSS_MASK_KEY] = mask
    if weights is not None:
        batch[ROLLOUT_IS_WEIGHTS_KEY] = weights.to(torch.float32)
    return metrics


def advantage_inputs(
    batch: Batch,
    *,
    scores: np.ndarray,
    extras: Mapping[str, np.ndarray],
    algorithm: AlgorithmSection,
    reward_baselines: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
) -> AdvantageInputs:
    """The estimator's inputs from the batch's columns, the scores (or token-level ``rewards``) and baselines."""
    loss_mask = batch[LOSS_MASK_KEY]
    params = algorithm.advantage_params()
    if rewards is None:
        rewards = last_token_rewards(scores=torch.from_numpy(np.asarray(scores)), response_mask=loss_mask)
    return AdvantageInputs(
        token_level_rewards=rewards,
        response_mask=loss_mask,
        index=np.asarray(batch[PROMPT_INDEX_KEY]),
        values=batch[VALUES_KEY] if VALUES_KEY in batch else None,
        old_log_probs=batch[OLD_LOG_PROBS_KEY] if OLD_LOG_PROBS_KEY in batch else None,
        sum_pi_squared=batch[SUM_PI_SQUARED_KEY] if SUM_PI_SQUARED_KEY in batch else None,
        rollout_is_weights=batch[ROLLOUT_IS_WEIGHTS_KEY] if ROLLOUT_IS_WEIGHTS_KEY in batch else None,
        reward_baselines=reward_baselines,
        reward_components=reward_components(extras, params.gdpo_reward_keys) if params.gdpo_reward_keys else None,
    )


def compute_step_advantages(
    batch: Batch,
    *,
    scores: np.ndarray,
    extras: Mapping[str, np.ndarray],
    algorithm: AlgorithmSection,
    reward_baselines: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
) -> AdvantageOutput:
    """``algorithm.adv_estimator``'s advantages (and returns) of the batch."""
    inputs = advantage_inputs(
        batch, scores=scores, extras=extras, algorithm=algorithm, reward_baselines=reward_baselines, rewards=rewards
    )
    return compute_advantage(adv_estimator=algorithm.adv_estimator, inputs=inputs, params=algorithm.advantage_params())


__all__ = [
    "advantage_inputs",
    "compute_step_advantages",
    "correct_rollout",
    "prompt_baselines",
    "reward_components",
    "token_level_rewards",
]
