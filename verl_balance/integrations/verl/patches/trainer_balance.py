"""Trainer-side DP balancing for verl: ``balance_batch`` and replacements for verl's ``_balance_batch``.

Both replacements (legacy ``RayPPOTrainer`` and v1 ``PPOTrainer``) keep verl's signature and its
``global_seqlen/*`` metrics, add ``verl_balance/*`` plan statistics, and weigh samples by
``state.current_workload()``, the same workload the patched micro-batch packer uses.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from verl_balance.balance import TooFewSamplesError, plan_balance
from verl_balance.batch_keys import ATTENTION_MASK_KEY, PLANNED_MICRO_BATCH_SIZES_KEY, UID_KEY
from verl_balance.integrations.verl.compat import required_batch_multiple, trainer_dp_size, worker_group_dp_size
from verl_balance.integrations.verl.patches.state import current_workload

__all__ = ["PLANNED_SIZES_KEY", "balance_batch", "balanced_balance_batch", "balanced_balance_batch_v1", "plan_dp_order"]

PLANNED_SIZES_KEY = PLANNED_MICRO_BATCH_SIZES_KEY
_STAT_KEYS = (
    "imbalance",
    "naive_imbalance",
    "sync_ratio",
    "naive_sync_ratio",
    "num_micro_batches",
    "naive_num_micro_batches",
)


def plan_dp_order(
    seq_lens: np.ndarray,
    *,
    dp_size: int,
    workload=None,
    micro_batch_size: int | None = None,
    max_token_len_per_gpu: int | None = None,
    sp_size: int = 1,
    group_ids: np.ndarray | None = None,
    mini_batch_size: int | None = None,
) -> tuple[list[int], list[list[int]], dict[str, float]]:
    """Row order that makes verl's equal DP chunking give rank r the plan's rows for r.
    Returns ``(order, rank_micro_batch_sizes, stats)``; each ``mini_batch_size`` mini-batch is
    planned separately, rank shares contiguous."""
    n = len(seq_lens)
    if micro_batch_size is None and max_token_len_per_gpu is None:
        micro_batch_size = n
    step = mini_batch_size or max(n, 1)
    spans = [(s, min(s + step, n)) for s in range(0, n, step)] or [(0, 0)]
    rank_rows: list[list[int]] = [[] for _ in range(dp_size)]
    rank_sizes: list[list[int]] = [[] for _ in range(dp_size)]
    stats: dict[str, float] = {}
    for start, stop in spans:
        plan = plan_balance(
            seq_lens=seq_lens[start:stop],
            dp_size=dp_size,
            sp_size=sp_size,
            micro_batch_size=micro_batch_size,
            max_token_len_per_gpu=max_token_len_per_gpu,
            group_ids=None if group_ids is None else group_ids[start:stop],
            workload=workload,
            equal_size=True,
        )
        sizes = {len(plan.rank_indices(r)) for r in range(dp_size)}
        if len(sizes) != 1:
            raise TooFewSamplesError(
                f"rows {start}..{stop} cannot be split into {dp_size} equal DP chunks (rank sizes {sorted(sizes)}); "
                "verl dispatches equal chunks: make the (mini-)batch size a multiple of dp_size (x group size)"
            )
        for r in range(dp_size):
            rank_rows[r].extend((plan.rank_indices(r) + start).tolist())
            rank_sizes[r].extend(int(s) for s in plan.micro_batch_sizes(r))
        for key in _STAT_KEYS:
            stats[key] = max(stats.get(key, 0.0), float(plan.stats[key]))
    order = [i for rows in rank_rows for i in rows]
    assert sorted(order) == list(range(n)), "balance plan lost or duplicated a row"
    return order, rank_sizes, stats


def balance_batch(
    batch,
    *,
    dp_size: int,
    workload=None,
    micro_batch_size: int | None = None,
    max_token_len_per_gpu: int | None = None,
    sp_size: int = 1,
    group_key: str | None = None,
    mini_batch_size: int | None = None,
) -> dict[str, float]:
    """Reorder a DataProto in place with our joint DP x micro-batch plan; returns metrics.

    Rank r's equal chunk then holds the plan's rows in micro-batch order;
    ``meta_info["verl_balance/micro_batch_sizes"]`` carries the sizes. ``group_key`` keeps rows
    with the same id on one rank.
    """
    seq_lens = batch.batch[ATTENTION_MASK_KEY].reshape(len(batch), -1).sum(-1).cpu().numpy().astype(np.int64)
    group_ids = None if group_key is None else np.asarray(batch.non_tensor_batch[group_key])
    order, rank_sizes, stats = plan_dp_order(
        seq_lens,
        dp_size=dp_size,
        workload=workload,
        micro_batch_size=micro_batch_size,
        max_token_len_per_gpu=max_token_len_per_gpu,
        sp_size=sp_size,
        group_ids=group_ids,
        mini_batch_size=mini_batch_size,
    )
    batch.reorder(torch.tensor(order, dtype=torch.long))
    batch.meta_info[PLANNED_SIZES_KEY] = rank_sizes
    return {f"verl_balance/{k}": v for k, v in stats.items()}


def _verl_seqlen_metrics(seqlens_before, seqlens_after, dp_size: int, prefix: str) -> dict:
    """verl's ``log_seqlen_unbalance`` metrics (balanced_* after, min/max/mean before reordering)."""
    from verl.utils.seqlen_balancing import log_seqlen_unbalance

    n = len(seqlens_after)
    chunks = [list(range(r * n // dp_size, (r + 1) * n // dp_size)) for r in range(dp_size)]
    after = log_seqlen_unbalance(seqlen_list=list(seqlens_after), partitions=chunks, prefix=prefix)
    before = log_seqlen_unbalance(seqlen_list=list(seqlens_before), partitions=chunks, prefix=prefix)
    for key in ("min", "max", "minmax_diff", "mean"):
        after[f"{prefix}/{key}"] = before[f"{prefix}/{key}"]
    return after


def balanced_balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
    """Replacement for legacy ``RayPPOTrainer._balance_batch`` (same signature) using ``balance_batch``."""
    actor_cfg = self.config.actor_rollout_ref.actor
    dp_size = trainer_dp_size(self, self.actor_rollout_wg, "actor")
    seqlens_before = batch.batch[ATTENTION_MASK_KEY].reshape(len(batch), -1).sum(-1).tolist()
    group_key = UID_KEY if getattr(self, "use_prefix_grouper", False) and UID_KEY in batch.non_tensor_batch else None
    mini = None
    if keep_minibatch:
        mini = int(actor_cfg.ppo_mini_batch_size) * int(self.config.actor_rollout_ref.rollout.n)
    # DP assignment only: verl's workers re-split their chunk into micro-batches themselves
    # (rearrange_micro_batches, ours once patched, with the same workload model).
    stats = balance_batch(
        batch, dp_size=dp_size, workload=current_workload(), group_key=group_key, mini_batch_size=mini
    )
    seqlens_after = batch.batch[ATTENTION_MASK_KEY].reshape(len(batch), -1).sum(-1).tolist()
    metrics.update(_verl_seqlen_metrics(seqlens_before, seqlens_after, dp_size, logging_prefix))
    metrics.update(stats)


def balanced_balance_batch_v1(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
    """Replacement for verl's default (v1) ``PPOTrainer._balance_batch`` (same signature and return),
    upsampling with verl's own padding first."""
    trainer_base = sys.modules["verl.trainer.ppo.v1.trainer_base"]
    dp_size = worker_group_dp_size(self.actor_rollout_wg, "actor")
    batch = trainer_base.upsample_batch_to_divisible_size(
        batch, required_batch_multiple(self, dp_size), self.tokenizer.eos_token_id
    )
    seqlens_before = [int(tag["seq_len"]) for tag in batch.tags]
    order, _, stats = plan_dp_order(
        np.asarray(seqlens_before, dtype=np.int64), dp_size=dp_size, workload=current_workload()
    )
    batch.reorder(order)
    seqlens_after = [seqlens_before[i] for i in order]
    metrics.update(_verl_seqlen_metrics(seqlens_before, seqlens_after, dp_size, logging_prefix))
    metrics.update({f"verl_balance/{k}": v for k, v in stats.items()})
    return batch
