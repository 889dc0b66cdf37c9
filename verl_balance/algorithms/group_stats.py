"""Vectorised group and masked statistics shared by the advantage estimators.

Invariants: no loop over groups (row order is irrelevant); float64; std unbiased (a singleton has std
0 here); ``masked_whiten`` is verl's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

WHITEN_EPS = 1e-8
"""verl's ``masked_whiten`` / ``masked_mean`` epsilon."""


class AdvantageInputError(ValueError):
    """Bad advantage inputs (scores, group labels, masks) or an unknown estimator; the message names the input."""


def group_ids(index, num_rows: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group labels to dense ids 0..G-1 (int64 tensor, CPU) and return G."""
    if index is None:
        raise AdvantageInputError("index (the prompt uid of each row) is required to group responses; got None")
    labels = np.asarray(index.cpu() if isinstance(index, torch.Tensor) else index)
    if labels.shape != (num_rows,):
        raise AdvantageInputError(f"index must have shape ({num_rows},) like scores, got {labels.shape}")
    _, inverse = np.unique(labels, return_inverse=True)
    return torch.from_numpy(inverse.reshape(-1).astype(np.int64)), int(inverse.max(initial=-1)) + 1


class GroupStats(NamedTuple):
    """Per-group statistics (each (G,) float64) of one value per row."""

    count: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def group_sum(values: torch.Tensor, ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum of ``values`` (rows first) per group: (G, *values.shape[1:])."""
    out = torch.zeros((num_groups, *values.shape[1:]), dtype=values.dtype, device=values.device)
    return out.index_add_(0, ids.to(values.device), values)


def group_mean_std(values: torch.Tensor, ids: torch.Tensor, num_groups: int) -> GroupStats:
    """Count, mean and unbiased std of ``values`` (B,) per group (std 0 for a group of one)."""
    values = values.to(torch.float64)
    count = group_sum(torch.ones_like(values), ids, num_groups)
    mean = group_sum(values, ids, num_groups) / count.clamp(min=1)
    centered = values - mean[ids]
    var = group_sum(centered.square(), ids, num_groups) / (count - 1).clamp(min=1)
    return GroupStats(count=count, mean=mean, std=var.sqrt())


def group_max(values: torch.Tensor, ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Maximum of ``values`` (B,) per group ((G,); -inf for a group without rows)."""
    out = torch.full((num_groups,), -torch.inf, dtype=values.dtype, device=values.device)
    return out.scatter_reduce_(0, ids.to(values.device), values, reduce="amax")


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's ``masked_whiten`` over the elements where ``mask`` is 1 (at least 2 needed)."""
    count = mask.sum()
    if count < 2:
        raise AdvantageInputError(
            f"whitening the advantages over the batch's response tokens needs at least 2 of them; the batch has "
            f"{int(count)} (every response is empty?)"
        )
    mean = (values * mask).sum() / (count + WHITEN_EPS)
    centered = values - mean
    var = (centered**2 * mask).sum() / (count + WHITEN_EPS) * (count / (count - 1))
    return centered * torch.rsqrt(var + WHITEN_EPS)
