"""Outcome estimators: one scalar score per response (the row sum of ``token_level_rewards``),
compared within its group, broadcast over the response tokens (``a_i * response_mask``).

Invariants (r_i the score of row i, group g, mean_g / unbiased std_g in float64):
- grpo, drgrpo, rloo and their vectorized forms: ``advantages.group_outcome_advantages``.
- opo: length-weighted group baseline; grpo_passk: only each group's best row is nonzero (every group
  needs 2 rows); gpg: alpha * (r_i - mean_g); reinforce_plus_plus_baseline: r_i - mean_g, whitened;
  gdpo: per-component group standardisation, weighted sum, whitened.
- A group of one gets a baseline of 0 (grpo: advantage 0).
"""

from __future__ import annotations

import torch

from verl_balance.algorithms.advantages import group_outcome_advantages, validated_scores
from verl_balance.algorithms.estimator_inputs import AdvantageInputs, AdvantageOutput, AdvantageParams
from verl_balance.algorithms.group_stats import (
    AdvantageInputError,
    group_ids,
    group_max,
    group_mean_std,
    group_sum,
    masked_whiten,
)


def row_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """r_i = sum over the row of ``token_level_rewards`` (float64, checked finite), as verl's estimators."""
    return validated_scores(inputs.token_level_rewards.to(torch.float64).sum(dim=-1))


def broadcast(per_row: torch.Tensor, inputs: AdvantageInputs, *, returns_too: bool = True) -> AdvantageOutput:
    """(B,) scalars -> (B, L) float32 ``a_i * response_mask``; returns = advantages, as verl's."""
    mask = inputs.response_mask
    adv = per_row.to(device=mask.device, dtype=torch.float32)[:, None] * mask.to(torch.float32)
    return AdvantageOutput(advantages=adv, returns=adv if returns_too else None)


def whitened(per_row: torch.Tensor, inputs: AdvantageInputs) -> AdvantageOutput:
    """(B,) scalars broadcast over the response tokens and whitened over all of them (float64)."""
    mask = inputs.response_mask.to(torch.float64)
    tokens = per_row.to(device=mask.device, dtype=torch.float64)[:, None] * mask
    adv = (masked_whiten(tokens, mask) * mask).to(torch.float32)
    return AdvantageOutput(advantages=adv, returns=adv)


def _same_as(estimator: str):
    def fn(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
        adv = group_outcome_advantages(
            scores=row_scores(inputs),
            index=inputs.index,
            estimator=estimator,
            norm_adv_by_std_in_grpo=params.norm_adv_by_std_in_grpo,
            epsilon=params.epsilon,
        )
        return broadcast(adv, inputs)

    fn.__doc__ = f"``advantages.group_outcome_advantages(estimator={estimator!r})`` on the row scores."
    return fn


grpo = _same_as("grpo")
drgrpo = _same_as("drgrpo")
rloo = _same_as("rloo")


def _centered_verl_singletons(scores: torch.Tensor, index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(r_i - mean_g with mean 0 for a group of one, group ids, group stats) as verl's loops."""
    ids, num_groups = group_ids(index, len(scores))
    stats = group_mean_std(scores, ids, num_groups)
    mean = torch.where(stats.count > 1, stats.mean, torch.zeros_like(stats.mean))
    return scores - mean[ids], ids, stats


def opo(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Length-weighted group baseline (see the module docstring)."""
    scores = row_scores(inputs)
    ids, num_groups = group_ids(inputs.index, len(scores))
    lengths = inputs.response_mask.to(torch.float64).sum(dim=-1).cpu()
    count = group_sum(torch.ones_like(lengths), ids, num_groups)
    total_len = group_sum(lengths, ids, num_groups)
    weighted = group_sum(lengths * scores.cpu(), ids, num_groups)
    usable = (count > 1) & (total_len > 0)
    baseline = torch.where(usable, weighted / total_len.clamp(min=1), torch.zeros_like(weighted))
    return broadcast(scores.cpu() - baseline[ids], inputs)


def grpo_passk(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Pass@k: only each group's best response is pushed, by its margin over the runner-up."""
    scores = row_scores(inputs).cpu()
    ids, num_groups = group_ids(inputs.index, len(scores))
    stats = group_mean_std(scores, ids, num_groups)
    small = (stats.count < 2).nonzero().flatten()
    if len(small):
        row = int((ids == small[0]).nonzero()[0])
        raise AdvantageInputError(
            f"algorithm.adv_estimator='grpo_passk' needs at least 2 responses per prompt (rollout.n >= 2); the "
            f"group of row {row} (uid {inputs.index[row]!r}) has {int(stats.count[small[0]])}"
        )
    best = group_max(scores, ids, num_groups)
    rows = torch.arange(len(scores))
    first_best = torch.full((num_groups,), len(scores), dtype=torch.int64)
    first_best.scatter_reduce_(0, ids, torch.where(scores == best[ids], rows, len(scores)), reduce="amin")
    is_best = rows == first_best[ids]
    runner_up = group_max(torch.where(is_best, -torch.inf, scores), ids, num_groups)
    margin = best - runner_up
    if params.norm_adv_by_std_in_grpo:
        margin = margin / (stats.std + params.epsilon)
    return broadcast(torch.where(is_best, margin[ids], torch.zeros_like(scores)), inputs)


def gpg(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Group mean baseline scaled by alpha = B / (non-zero scores) (GPG, verl's f_norm = 1)."""
    scores = row_scores(inputs).cpu()
    centered, _, _ = _centered_verl_singletons(scores, inputs.index)
    alpha = len(scores) / max(int(torch.count_nonzero(scores)), 1)
    return broadcast(alpha * centered, inputs)


def reinforce_plus_plus_baseline(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Group mean baseline, then whitened over the batch's response tokens (REINFORCE++-baseline)."""
    centered, _, _ = _centered_verl_singletons(row_scores(inputs).cpu(), inputs.index)
    return whitened(centered, inputs)


def _gdpo_components(inputs: AdvantageInputs, params: AdvantageParams) -> tuple[list[torch.Tensor], list[float]]:
    if not params.gdpo_reward_keys:
        return [row_scores(inputs).cpu()], [1.0]
    components = inputs.reward_components or {}
    missing = [k for k in params.gdpo_reward_keys if k not in components]
    if missing:
        raise AdvantageInputError(
            f"algorithm.gdpo_reward_keys names {missing}, which the reward function did not return; it returned "
            f"{sorted(components)} (the reward function must return a dict with these keys)"
        )
    weights = params.gdpo_reward_weights
    if weights is not None and len(weights) != len(params.gdpo_reward_keys):
        raise AdvantageInputError(
            f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(params.gdpo_reward_keys)} "
            f"algorithm.gdpo_reward_keys; give one weight per key"
        )
    scores = [validated_scores(torch.as_tensor(components[k]).to(torch.float64).cpu()) for k in params.gdpo_reward_keys]
    return scores, list(weights) if weights is not None else [1.0] * len(scores)


def gdpo(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Each reward component standardised in its group, weighted, summed, whitened (GDPO)."""
    total = None
    for scores, weight in zip(*_gdpo_components(inputs, params)):
        centered, ids, stats = _centered_verl_singletons(scores, inputs.index)
        if params.norm_adv_by_std_in_grpo:
            std = torch.where(stats.count > 1, stats.std, torch.ones_like(stats.std))
            centered = centered / (std[ids] + params.epsilon)
        total = weight * centered if total is None else total + weight * centered
    return whitened(total, inputs)
