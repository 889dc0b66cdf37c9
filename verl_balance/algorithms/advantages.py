"""Outcome-reward advantage estimators for GRPO-style training (one scalar score per response).

Invariants:
- Input: ``scores[i]`` is the scalar reward of response i; ``index[i]`` names its group (the
  prompt uid: all n responses to one prompt share it). Groups are arbitrary hashable labels in
  any order; rows of a group need not be contiguous.
- Output is token-aligned (B, L): ``advantages[i, t] = a_i * loss_mask[i, t]``, so it is 0 on
  prompt and padding tokens and constant over the response tokens of a sequence.
- grpo: a_i = (r_i - mean_g) / (std_g + epsilon), std the unbiased (Bessel) sample std of the
  group, as in verl (``torch.std``). With ``norm_adv_by_std_in_grpo=False`` a_i = r_i - mean_g
  (Dr.GRPO, https://arxiv.org/abs/2503.20783; pair it with loss_agg_mode
  ``seq-mean-token-sum-norm`` to also drop the per-sequence length normalisation).
- rloo: a_i = r_i - mean of the other responses of the group = n/(n-1) * (r_i - mean_g).
- A group of size 1 has no baseline, so its advantage is 0 (no gradient). verl instead uses
  mean 0 and std 1 there, i.e. a_i = r_i; we deliberately do not push a lone sample by its raw
  reward.
- Group statistics are computed in float64 and vectorised (no Python loop over groups); the
  result does not depend on the order of the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ADV_ESTIMATORS = ("grpo", "drgrpo", "rloo")


class AdvantageInputError(ValueError):
    """Bad scores/index/mask or an unknown estimator."""


def _group_ids(index, num_rows: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels to dense ids 0..G-1 (int64 tensor) and return G."""
    labels = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index)
    if labels.shape != (num_rows,):
        raise AdvantageInputError(f"index must have shape ({num_rows},) like scores, got {labels.shape}")
    _, inverse = np.unique(labels, return_inverse=True)
    return torch.from_numpy(inverse.reshape(-1).astype(np.int64)), int(inverse.max(initial=-1)) + 1


def _validated_scores(scores) -> torch.Tensor:
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
    if estimator not in ADV_ESTIMATORS:
        raise AdvantageInputError(f"adv_estimator={estimator!r} is not supported; valid: {list(ADV_ESTIMATORS)}")
    scores = _validated_scores(scores)
    device = scores.device
    values = scores.detach().to("cpu", torch.float64)
    group, num_groups = _group_ids(index, len(values))

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
    )


def compute_advantages(
    *,
    adv_estimator: str,
    scores,
    index: np.ndarray | Sequence | torch.Tensor,
    loss_mask: torch.Tensor,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Token-aligned (B, L) float32 advantages ``a_i * loss_mask[i, t]`` for an estimator in ADV_ESTIMATORS."""
    if loss_mask.dim() != 2:
        raise AdvantageInputError(f"loss_mask must be (B, L), got shape {tuple(loss_mask.shape)}")
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
    return per_response.to(loss_mask.device)[:, None] * loss_mask.to(torch.float32)
