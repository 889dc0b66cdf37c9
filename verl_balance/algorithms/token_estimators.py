"""Estimators with a value per token: returns-to-go over the response tokens, against a per-token
baseline (reinforce_plus_plus, remax, the optimal-token baselines) or the critic's values (gae).

Invariants (float64 inside, float32 out, 0 outside the response mask):
- Returns G_t skip masked tokens, so G_t on response tokens equals verl's on the response slice.
- reinforce_plus_plus: G whitened over the batch's response tokens; remax: G_t - b_i
  (``reward_baselines``); optimal_token_baseline: G - B with B a group-weighted baseline per
  response position (a group of one: a = G).
- Group aggregation is one ``index_add_`` over (group, position) keys: no loop over groups.
"""

from __future__ import annotations

import torch

from verl_balance.algorithms.advantages import compute_gae
from verl_balance.algorithms.estimator_inputs import AdvantageInputs, AdvantageOutput, AdvantageParams
from verl_balance.algorithms.group_stats import AdvantageInputError, group_ids, group_max, group_sum, masked_whiten


def _f64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(torch.float64)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_next over the masked tokens (skipping the others), 0 off the mask."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        new = rewards[:, t] + gamma * running
        returns[:, t] = new * mask[:, t]
        running = new * mask[:, t] + running * (1 - mask[:, t])
    return returns


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Undiscounted returns over the masked tokens: reverse cumulative sum of r * mask, 0 off the mask."""
    return (rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask


def reinforce_plus_plus(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Discounted returns whitened over the batch's response tokens (REINFORCE++)."""
    mask = _f64(inputs.response_mask)
    returns = discounted_returns(_f64(inputs.token_level_rewards), mask, params.gamma)
    advantages = masked_whiten(returns, mask) * mask
    return AdvantageOutput(advantages=advantages.float(), returns=returns.float())


def remax(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Reward-to-go minus the greedy response's reward (ReMax)."""
    mask = _f64(inputs.response_mask)
    baselines = _f64(torch.as_tensor(inputs.reward_baselines)).to(mask.device)
    if baselines.shape != (mask.shape[0],):
        raise AdvantageInputError(
            f"reward_baselines must be one greedy-response reward per row, shape ({mask.shape[0]},); "
            f"got {tuple(baselines.shape)}"
        )
    returns = reward_to_go(_f64(inputs.token_level_rewards), mask)
    advantages = returns - baselines[:, None] * mask
    return AdvantageOutput(advantages=advantages.float(), returns=returns.float())


def gae(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """``advantages.compute_gae`` with ``algorithm.gamma`` / ``algorithm.lam``."""
    advantages, returns = compute_gae(
        token_level_rewards=inputs.token_level_rewards,
        values=inputs.values,
        response_mask=inputs.response_mask,
        gamma=params.gamma,
        lam=params.lam,
    )
    return AdvantageOutput(advantages=advantages, returns=returns)


def _path_variance(inputs: AdvantageInputs, mask: torch.Tensor) -> torch.Tensor:
    """W_t: cumulative w over the row's response tokens (see the module docstring)."""
    w = 1 - 2 * _f64(inputs.old_log_probs).exp() + _f64(inputs.sum_pi_squared)
    if inputs.rollout_is_weights is not None:
        w = w * _f64(inputs.rollout_is_weights).square()
    return (w * mask).cumsum(-1)


def _zero_tail(lengths: torch.Tensor, ids: torch.Tensor, num_groups: int, member: torch.Tensor) -> torch.Tensor:
    """(B,) the response position from which a row has no baseline (past every position when untouched)."""
    lengths = torch.where(member, lengths, -1)
    longest = group_max(lengths.double(), ids, num_groups).long()
    is_longest = member & (lengths == longest[ids])
    unique = group_sum(is_longest.long(), ids, num_groups) == 1
    second = group_max(torch.where(is_longest, -1, lengths).double(), ids, num_groups).long()
    cut = is_longest & unique[ids] & (longest[ids] > second[ids])
    return torch.where(cut, second[ids], torch.iinfo(torch.int64).max)


def _optimal_token_baseline(inputs: AdvantageInputs, params: AdvantageParams, *, compress: bool) -> AdvantageOutput:
    mask = _f64(inputs.response_mask).cpu()
    batch, width = mask.shape
    returns = reward_to_go(_f64(inputs.token_level_rewards).cpu(), mask)
    path_var = _path_variance(inputs, mask).cpu()
    ids, num_groups = group_ids(inputs.index, batch)
    lengths = mask.sum(-1).long()
    if compress:  # rank among the row's response tokens
        positions = (mask.cumsum(-1) - 1).clamp(min=0).long()
    else:  # offset from the row's first response token
        start = torch.where(lengths > 0, mask.argmax(-1), 0)
        positions = (torch.arange(width)[None, :] - start[:, None]).clamp(min=0)
    member = lengths > 0 if compress else torch.ones(batch, dtype=torch.bool)
    keys = (ids[:, None] * width + positions).reshape(-1)
    numerator = torch.zeros(num_groups * width, dtype=torch.float64).index_add_(0, keys, (returns * path_var).flatten())
    denominator = torch.zeros(num_groups * width, dtype=torch.float64).index_add_(0, keys, (path_var * mask).flatten())
    baseline = (numerator / (denominator + params.otb_epsilon))[keys].reshape(batch, width)
    group_rows = group_sum(member.long(), ids, num_groups)
    keep = (group_rows[ids] > 1) & member
    if params.otb_handle_zero_tail:
        tail = _zero_tail(lengths, ids, num_groups, member)
        keep = keep[:, None] & (positions < tail[:, None])
    else:
        keep = keep[:, None].expand(batch, width)
    advantages = (returns - torch.where(keep, baseline, 0.0)) * mask
    device = inputs.response_mask.device
    return AdvantageOutput(advantages=advantages.float().to(device), returns=returns.float().to(device))


def optimal_token_baseline(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Per-position optimal baseline of each group (positions from the response start)."""
    return _optimal_token_baseline(inputs, params, compress=False)


def tir_optimal_token_baseline(*, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """The multi-turn (tool-integrated) optimal token baseline: positions among response tokens only."""
    return _optimal_token_baseline(inputs, params, compress=True)
