"""The loss contract of ``verl_balance.loss`` for verl-shaped ``(bs, response_length)`` loss matrices.

``loss_counts`` takes N and S over the whole mini-batch (DP group only); ``agg_loss`` is a
layout-invariant replacement for verl's ``core_algos.agg_loss`` on one micro-batch, built on the
one weights function ``loss.compute_token_weights``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["LossCounts", "agg_loss", "loss_counts"]


@dataclass(frozen=True)
class LossCounts:
    """Global counts of one mini-batch: N (loss tokens) and S (sequences with >= 1 loss token)."""

    num_tokens: int
    num_sequences: int


def loss_counts(loss_masks: Sequence[torch.Tensor] | torch.Tensor, *, dp_group=None) -> LossCounts:
    """N and S over the whole mini-batch: every local micro-batch, all-reduced (SUM) over ``dp_group``.

    Pass full (unsliced) ``(bs, response_length)`` masks of all of this rank's micro-batches, once
    per mini-batch. The reduction is over the DP group only: SP ranks of one DP group hold the
    same sequences, so a world reduction would count every token sp times (the SP-halved loss)."""
    from verl_balance.loss import sequence_token_counts

    masks = [loss_masks] if isinstance(loss_masks, torch.Tensor) else list(loss_masks)
    device = masks[0].device if masks else torch.device("cpu")
    totals = torch.zeros(2, dtype=torch.int64, device=device)
    for mask in masks:
        rows, width = mask.shape
        cu_seqlens = torch.arange(rows + 1, device=mask.device) * width
        per_sequence = sequence_token_counts(mask.reshape(-1), cu_seqlens)
        totals += torch.stack([per_sequence.sum(), (per_sequence > 0).sum()]).to(device)
    import torch.distributed as dist

    if dp_group is not None and dist.is_initialized() and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=dp_group)
    return LossCounts(num_tokens=int(totals[0]), num_sequences=int(totals[1]))


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    counts: LossCounts,
    grad_scale: float = 1.0,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Layout-invariant replacement for verl's ``core_algos.agg_loss`` on one micro-batch.

    Returns ``grad_scale * sum(w * loss_mat)`` with the contract weights w of ``verl_balance.loss``
    (token-mean m/N, seq-mean-token-mean m/(n_i S), seq-mean-token-sum m/S,
    seq-mean-token-sum-norm m/(S C), token-sum m), N and S from ``loss_counts`` over the whole mini-batch.
    ``grad_scale`` is G, the number of ranks the gradient reduction averages over for disjoint
    data (verl's FSDP: its ``dp_size``); back-propagate the result. The logged loss is the SUM of
    the unscaled values over all micro-batches and DP ranks, identical for every layout.
    """
    from verl_balance.loss import compute_token_weights

    rows, width = loss_mask.shape
    cu_seqlens = torch.arange(rows + 1, device=loss_mask.device) * width
    # The one weights function, on this micro-batch alone: its normalisers are the local counts,
    # so rescale them to the mini-batch's global N (token-mean) or S (seq-mean-* modes).
    local = compute_token_weights(
        loss_masks=[loss_mask.reshape(-1)],
        cu_seqlens=[cu_seqlens],
        agg_mode=loss_agg_mode,
        loss_scale_factor=loss_scale_factor,
        dp_group=None,
    )
    if loss_agg_mode == "token-sum":
        to_global = 1.0  # no normaliser: the sum over the micro-batch is its share of the mini-batch's sum
    elif loss_agg_mode == "token-mean":
        to_global = local.num_tokens / max(counts.num_tokens, 1)
    else:
        to_global = local.num_sequences / max(counts.num_sequences, 1)
    # A zero global count means every mask it covers is zero too: the weights are 0, never 0/0.
    weights = local.weights[0].reshape(rows, width).to(loss_mat.dtype) * to_global
    return grad_scale * (weights * loss_mat).sum()
