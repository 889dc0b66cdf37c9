"""verl 0.9.1's own two-stage plan for given batches (run under verl's venv; prints JSON).

Used by ``sft_bench.py`` for its "verl" rows, so that column calls verl's code instead of a copy:

1. ``RayPPOTrainer._balance_batch`` (trainer side): ``get_seqlen_balanced_partitions`` of
   ``calculate_workload`` (24576 L + L^2) over the DP ranks with equal counts, each partition
   sorted by workload with the small samples at both ends, then DP dispatch in contiguous chunks;
2. ``prepare_micro_batches`` (worker side): fixed size = contiguous ``chunk_tensordict`` of the
   rank's rows; token cap = ``rearrange_micro_batches`` per rank with the micro-batch count
   agreed by an all-reduce MAX over DP, replayed here on one process with ``min_num_micro_batch``.

    echo '[{"dp": 2, "micro_batch_size": 4, "max_token_len_per_gpu": null, "batches": [[...]]}]' \\
        | python benchmarks/verl_plans.py   # a Python with verl 0.9.x installed

Input: a list of cases (micro_batch_size or max_token_len_per_gpu set, the other null).
Output: {"verl_version": ..., "cases": [[plan per batch] per case]}, plan[dp_rank][micro_idx] =
sample indices into that batch.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def balance_batch_order(lengths: list[int], dp: int) -> list[int]:
    """Row order after verl's RayPPOTrainer._balance_batch (called unbound on a stand-in trainer)."""
    import torch
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    batch = DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(len(lengths))})
    trainer = SimpleNamespace(
        _get_dp_size=lambda worker_group, role: dp, actor_rollout_wg=None, use_prefix_grouper=False
    )
    RayPPOTrainer._balance_batch(trainer, batch, metrics={})
    return batch.batch["row"].tolist()


def rank_micro_batches(rank_rows: list[list[int]], lengths: list[int], *, micro_batch_size, cap) -> list:
    """verl's worker-side micro-batching of each rank's rows (indices into the global batch)."""
    import torch
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    if micro_batch_size is not None:
        return [[rows[i : i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)] for rows in rank_rows]
    tds = []
    for rows in rank_rows:
        lens = torch.tensor([lengths[r] for r in rows])
        mask = (torch.arange(int(lens.max()))[None, :] < lens[:, None]).long()
        tds.append(TensorDict({"input_ids": mask.clone(), "attention_mask": mask}, batch_size=[len(rows)]))
    agreed = None
    while True:  # the DP all-reduce MAX of the per-rank micro-batch counts
        cells = []
        for rows, td in zip(rank_rows, tds):
            _, idx = rearrange_micro_batches(td, max_token_len=cap, min_num_micro_batch=agreed)
            cells.append([[rows[i] for i in mb] for mb in idx])
        count = max(len(c) for c in cells)
        if all(len(c) == count for c in cells):
            return cells
        agreed = count


def plans_for(case: dict) -> list:
    """verl's plan of every batch of one case."""
    dp = int(case["dp"])
    plans = []
    for lengths in case["batches"]:
        order = balance_batch_order(lengths, dp)
        per_rank = len(order) // dp  # verl's DP dispatch: equal contiguous chunks
        rank_rows = [order[r * per_rank : (r + 1) * per_rank] for r in range(dp)]
        plans.append(
            rank_micro_batches(
                rank_rows, lengths, micro_batch_size=case["micro_batch_size"], cap=case["max_token_len_per_gpu"]
            )
        )
    return plans


def main() -> None:
    cases = json.load(sys.stdin)
    import verl

    json.dump({"verl_version": verl.__version__, "cases": [plans_for(c) for c in cases]}, sys.stdout)


if __name__ == "__main__":
    main()
