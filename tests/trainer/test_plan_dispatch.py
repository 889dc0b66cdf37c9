"""Applying a BalancePlan to a Batch (trainer/plan_dispatch.py), against hand-built plans and
row-identifying values: every kept row reaches exactly one rank in micro-batch order, merge
restores input order, and truncation decided by the plan is applied to the chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_balance.balance.plan import BalancePlan, plan_balance
from verl_balance.protocol import Batch, BatchError
from verl_balance.trainer.plan_dispatch import merge_by_plan, plan_batch, run_by_plan, split_by_plan


def make_batch(n: int = 6) -> Batch:
    """Row i carries i everywhere, so any row permutation is visible in every column."""
    return Batch.from_dict(
        tensors={"input_ids": torch.arange(n * 3).reshape(n, 3), "score": torch.arange(n, dtype=torch.float32) / 10},
        non_tensors={"uid": [f"s{i}" for i in range(n)]},
        meta={"temperature": 1.0},
    )


def assert_rows(batch: Batch, rows: list[int]) -> None:
    """``batch`` holds exactly rows ``rows`` of ``make_batch``, in that order, in every column."""
    rows_t = torch.tensor(rows, dtype=torch.long)
    assert torch.equal(batch["input_ids"], torch.arange(max(rows, default=0) * 3 + 3).reshape(-1, 3)[rows_t])
    assert batch["uid"].tolist() == [f"s{i}" for i in rows]


def hand_plan() -> BalancePlan:
    # rank 0: micro-batches [5, 1] and [7]; rank 1: [0, 3] and [2, 6]; sample 4 skipped
    return BalancePlan(
        micro_batches=[[np.array([5, 1]), np.array([7])], [np.array([0, 3]), np.array([2, 6])]],
        skipped=np.array([4]),
    )


def test_split_by_plan_gives_each_rank_its_rows_in_micro_batch_order():
    chunks = split_by_plan(make_batch(8), hand_plan())
    assert len(chunks) == 2
    assert_rows(chunks[0], [5, 1, 7])
    assert_rows(chunks[1], [0, 3, 2, 6])
    assert chunks[0].meta["micro_batch_sizes"] == [2, 1] and chunks[1].meta["micro_batch_sizes"] == [2, 2]
    assert chunks[0].meta["temperature"] == 1.0
    micro = chunks[1].split(chunks[1].meta["micro_batch_sizes"])
    assert_rows(micro[1], [2, 6])


def test_merge_by_plan_restores_input_order_of_kept_samples():
    plan = hand_plan()
    chunks = split_by_plan(make_batch(8), plan)
    outputs = [c.select(batch_keys=["score"], non_tensor_batch_keys=["uid"]) for c in chunks]
    merged = merge_by_plan(outputs, plan)
    assert merged["uid"].tolist() == ["s0", "s1", "s2", "s3", "s5", "s6", "s7"]  # s4 was skipped
    assert torch.equal(merged["score"], torch.tensor([0, 1, 2, 3, 5, 6, 7]) / 10)
    assert "micro_batch_sizes" not in merged.meta
    # the same from one Batch concatenated in DP order (what a DP dispatch collects)
    assert merge_by_plan(Batch.concat(outputs), plan)["uid"].tolist() == merged["uid"].tolist()
    # negative control: the concatenated outputs themselves are not in input order
    assert Batch.concat(outputs)["uid"].tolist() != merged["uid"].tolist()


def test_split_merge_round_trip_for_random_plans():
    rng = np.random.default_rng(0)
    for dp_size in (1, 2, 3, 4):
        n = int(rng.integers(dp_size, 40))
        seq_lens = rng.integers(1, 100, size=n)
        plan = plan_balance(seq_lens=seq_lens, dp_size=dp_size, max_token_len_per_gpu=int(seq_lens.max()) * 3)
        merged = run_by_plan(make_batch(n), plan, lambda chunks: chunks)
        kept = np.setdiff1d(np.arange(n), plan.skipped)
        assert_rows(merged, kept.tolist())


def test_split_and_merge_reject_wrong_sizes():
    plan = hand_plan()
    chunks = split_by_plan(make_batch(8), plan)
    with pytest.raises(BatchError, match="DP rank 1 has 3 rows"):
        merge_by_plan([chunks[0], chunks[1][:3]], plan)
    with pytest.raises(BatchError, match="dp_size=2"):
        merge_by_plan(chunks[:1], plan)
    with pytest.raises(BatchError, match="plan places 7"):
        merge_by_plan(make_batch(8), plan)
    with pytest.raises(BatchError, match="batch has 5 rows"):
        split_by_plan(make_batch(5), plan)


def _padded_batch(lengths: list[int]) -> Batch:
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = (torch.arange(width)[None, :] + 1).repeat(len(lengths), 1) * mask
    return Batch.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "loss_mask": mask})


def test_chunks_carry_the_truncation_the_plan_decided():
    """overlong=truncate: the sample the plan cut arrives cut (mask and every (B, L) tensor)."""
    lengths = [5, 30, 7, 6]
    batch = _padded_batch(lengths)
    plan = plan_batch(
        batch,
        dp_size=2,
        sp_size=1,
        micro_batch_size=None,
        token_cap=12,
        balance=True,
        workload=None,
        overlong="truncate",
    )
    assert plan.truncated == {1: 12}  # independent of this module: the planner's decision
    chunks = split_by_plan(batch, plan)
    rows = merge_by_plan(chunks, plan)
    assert rows["attention_mask"].sum(1).tolist() == [5, 12, 7, 6]
    assert rows["loss_mask"].sum(1).tolist() == [5, 12, 7, 6]
    assert int(rows["input_ids"][1].count_nonzero()) == 12
    # every micro-batch respects the cap (negative control: the uncut sample alone exceeds it)
    for chunk in chunks:
        for micro in chunk.split(chunk.meta["micro_batch_sizes"]):
            assert int(micro["attention_mask"].sum()) <= 12
    assert int(batch["attention_mask"][1].sum()) > 12


@pytest.mark.parametrize("group_scope, token_cap", [("micro_batch", 100), ("rank", 40)])
def test_plan_batch_keeps_groups_on_one_rank_in_either_scope(group_scope, token_cap):
    """A group never spans DP ranks; with group_scope="micro_batch" it never spans micro-batches
    either, while "rank" accepts a cap (40) smaller than a whole group (up to 76 tokens)."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 20, size=24).tolist()
    batch = _padded_batch(lengths)
    groups = np.repeat(np.arange(6), 4)
    plan = plan_batch(
        batch,
        dp_size=3,
        sp_size=1,
        micro_batch_size=None,
        token_cap=token_cap,
        balance=True,
        workload=None,
        group_ids=groups,
        group_scope=group_scope,
    )
    places = {"rank": {}, "micro_batch": {}}
    for r, rank in enumerate(plan.micro_batches):
        for j, mb in enumerate(rank):
            for g in groups[mb].tolist():
                places["rank"].setdefault(g, set()).add(r)
                places["micro_batch"].setdefault(g, set()).add((r, j))
    assert sorted(places["rank"]) == list(range(6))
    assert all(len(ranks) == 1 for ranks in places["rank"].values())
    spans_micro_batches = any(len(cells) > 1 for cells in places["micro_batch"].values())
    assert spans_micro_batches == (group_scope == "rank")
