"""Applying a ``BalancePlan`` to a global batch: plan it, cut it into per-DP-rank chunks, and put
the workers' per-row outputs back in the batch's row order.

``merge_by_plan(split_by_plan(b, plan), plan)`` equals ``b`` (minus skipped samples, truncated ones
cut), whatever the plan's permutation. The worker group sends chunk r to every SP rank of DP rank r.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from verl_balance.balance import BalancePlan, Workload, plan_balance
from verl_balance.batch_keys import ATTENTION_MASK_KEY, MICRO_BATCH_SIZES_KEY
from verl_balance.protocol import Batch, BatchError

__all__ = ["apply_truncation", "merge_by_plan", "plan_batch", "run_by_plan", "split_by_plan"]


def plan_batch(
    batch: Batch,
    *,
    dp_size: int,
    sp_size: int,
    micro_batch_size: int | None,
    token_cap: int | None,
    balance: bool,
    workload: Workload,
    overlong: str = "error",
    group_ids=None,
    group_scope: str = "micro_batch",
) -> BalancePlan:
    """BalancePlan of one global batch from its ``attention_mask`` lengths.

    ``token_cap`` (tokens per SP rank) takes precedence over ``micro_batch_size``; ``balance=False``
    gives the contiguous split. Rows sharing a ``group_ids`` id stay on one DP rank, and in one
    micro-batch when ``group_scope="micro_batch"``."""
    return plan_balance(
        seq_lens=batch[ATTENTION_MASK_KEY].sum(dim=1).cpu().numpy(),
        dp_size=dp_size,
        sp_size=sp_size,
        micro_batch_size=None if token_cap is not None else micro_batch_size,
        max_token_len_per_gpu=token_cap,
        balance=balance,
        group_ids=None if group_ids is None else np.asarray(group_ids),
        group_scope=group_scope,
        workload=workload,
        overlong=overlong,
    )


def apply_truncation(batch: Batch, plan: BalancePlan) -> Batch:
    """``batch`` with each truncated sample cut to its planned length (mask and every (B, L) tensor zeroed past it)."""
    if not plan.truncated:
        return batch
    mask = batch[ATTENTION_MASK_KEY].clone()
    for index, new_len in plan.truncated.items():
        mask[int(index), int(new_len) :] = 0
    out = batch.select()
    for key in out.tensor_keys:
        value = out[key]
        if key != ATTENTION_MASK_KEY and value.shape == mask.shape:
            out[key] = value * mask.to(value.dtype)
    out[ATTENTION_MASK_KEY] = mask
    return out


def _rank_indices(plan: BalancePlan) -> list[np.ndarray]:
    return [np.asarray(plan.rank_indices(r), dtype=np.int64) for r in range(plan.dp_size)]


def split_by_plan(batch: Batch, plan: BalancePlan) -> list[Batch]:
    """One Batch per DP rank holding that rank's rows in the plan's micro-batch order (truncated samples
    cut, skipped ones absent); each chunk's meta ``MICRO_BATCH_SIZES_KEY`` gives its micro-batch sizes."""
    rank_indices = _rank_indices(plan)
    used = np.concatenate(rank_indices) if rank_indices else np.zeros(0, dtype=np.int64)
    if used.size and (used.min() < 0 or used.max() >= len(batch)):
        raise BatchError(f"the plan indexes samples up to {int(used.max())}, but the batch has {len(batch)} rows")
    if np.unique(used).size != used.size:
        raise BatchError("the plan assigns some sample to more than one place")
    batch = apply_truncation(batch, plan)
    chunks = []
    for r, indices in enumerate(rank_indices):
        chunk = batch.index_select(indices)
        sizes = [int(s) for s in plan.micro_batch_sizes(r)]
        assert sum(sizes) == len(indices), "plan micro-batch sizes disagree with its rank indices"
        chunk.meta[MICRO_BATCH_SIZES_KEY] = sizes
        chunks.append(chunk)
    return chunks


def merge_by_plan(outputs: Batch | Sequence[Batch], plan: BalancePlan) -> Batch:
    """Undo ``split_by_plan``: rows back in input order. ``outputs``: the per-DP-rank list (plan order) or
    one Batch concatenated in DP-rank order."""
    rank_sizes = [len(ix) for ix in _rank_indices(plan)]
    if isinstance(outputs, Batch):
        if len(outputs) != sum(rank_sizes):
            raise BatchError(f"merged output has {len(outputs)} rows; the plan places {sum(rank_sizes)} samples")
        merged = outputs.select()
    else:
        outputs = list(outputs)
        if len(outputs) != plan.dp_size:
            raise BatchError(f"got {len(outputs)} per-rank outputs for a plan with dp_size={plan.dp_size}")
        for r, (out, size) in enumerate(zip(outputs, rank_sizes)):
            if len(out) != size:
                raise BatchError(f"output of DP rank {r} has {len(out)} rows; the plan gave that rank {size} samples")
        merged = Batch.concat(outputs)
    merged = merged.index_select(np.asarray(plan.inverse_permutation, dtype=np.int64))
    merged.meta.pop(MICRO_BATCH_SIZES_KEY, None)
    return merged


def run_by_plan(batch: Batch, plan: BalancePlan, call: Callable[[list[Batch]], Batch]) -> Batch:
    """``call(split_by_plan(batch, plan))`` with its per-row outputs put back in ``batch`` order."""
    return merge_by_plan(call(split_by_plan(batch, plan)), plan)
