"""Micro-batch count under a token cap: never more than a simple two-stage packing needs.

Regression for heavy-tailed lengths (a few samples near the cap), where the joint row layout
alone needed up to 14 micro-batches per rank where 8 suffice. The reference is independent of
the planner: an equal-count DP split by a greedy on tokens (longest first, to the rank with the
fewest tokens that still has count room), then first-fit-decreasing per rank, with the count
agreed across ranks (the max), as verl's balance_batch + rearrange_micro_batches pipeline does.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from verl_balance.balance import FlopsWorkload, plan_balance

FLOPS_7B = FlopsWorkload(
    num_layers=32, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32, vocab_size=32000
)


def reference_two_stage_count(lengths: np.ndarray, dp_size: int, token_cap: int) -> int:
    """Micro-batches per rank of greedy equal-count DP split + first-fit-decreasing per rank."""
    max_count = -(-len(lengths) // dp_size)
    rank_tokens, rank_items = [0] * dp_size, [[] for _ in range(dp_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min((r for r in range(dp_size) if len(rank_items[r]) < max_count), key=lambda r: (rank_tokens[r], r))
        rank_items[rank].append(int(lengths[i]))
        rank_tokens[rank] += int(lengths[i])
    counts = []
    for items in rank_items:
        bins: list[int] = []
        for length in sorted(items, reverse=True):
            for b, used in enumerate(bins):
                if used + length <= token_cap:
                    bins[b] += length
                    break
            else:
                bins.append(length)
        counts.append(max(1, len(bins)))
    return max(counts)


def heavy_tailed(n: int, cap: int, seed: int, sigma: float = 0.9) -> np.ndarray:
    """Lognormal lengths (median ~665) clipped to 16..cap: a few samples sit exactly at the cap."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.5, sigma, n).astype(np.int64), 16, cap)


def assert_cap_and_count(plan, lengths, dp_size, sp_size, cap_per_gpu):
    """Cap per SP rank after padding, equal counts, and count <= reference (<= bound + 1 when it is)."""
    token_cap = cap_per_gpu * sp_size
    for rank in plan.micro_batches:
        assert len(rank) == plan.num_micro_batches
        for mb in rank:
            assert -(-int(lengths[mb].sum()) // sp_size) <= cap_per_gpu
    reference = reference_two_stage_count(lengths, dp_size, token_cap)
    assert plan.num_micro_batches <= reference, (plan.num_micro_batches, reference)
    bound = max(1, -(-int(lengths.sum()) // (dp_size * token_cap)))
    if reference <= bound + 1:
        assert plan.num_micro_batches <= bound + 1
    return reference


# The cases of the report (dp 8 / 1024 rows / cap 16k gave 14 micro-batches; dp 16 / cap 8k gave 6-7).
REPORTED = [(8, 256, 16384), (8, 1024, 16384), (16, 512, 8192)]


@pytest.mark.parametrize("dp_size,num_rows,cap", REPORTED)
@pytest.mark.parametrize("workload", [None, FLOPS_7B], ids=["tokens", "flops"])
def test_micro_batch_count_at_most_two_stage_reference_on_reported_cases(dp_size, num_rows, cap, workload):
    for seed in range(3):
        lengths = heavy_tailed(num_rows, cap, seed)
        plan = plan_balance(seq_lens=lengths, dp_size=dp_size, max_token_len_per_gpu=cap, workload=workload)
        assert_cap_and_count(plan, lengths, dp_size, 1, cap)


def test_heavy_tailed_case_keeps_joint_quality():
    # dp 8, seed 1 holds a sample at the cap: the count must be the bound and the synchronised cost
    # must stay well below the 1.09 the 14-micro-batch plan had (1.038 today; 1.073 for verl).
    lengths = heavy_tailed(1024, 16384, 1)
    plan = plan_balance(seq_lens=lengths, dp_size=8, max_token_len_per_gpu=16384, workload=FLOPS_7B)
    assert plan.num_micro_batches == plan.stats["micro_batch_bound"] == 8
    assert plan.stats["sync_ratio"] < 1.05


def test_samples_at_the_cap_each_get_a_micro_batch_without_extra_slots():
    # 2 ranks, 4 samples exactly at the cap and 60 short ones: the bound is
    # ceil((4 * 1000 + 60 * 100) / (2 * 1000)) = 5 slots, which a packing achieves.
    lengths = np.array([1000] * 4 + [100] * 60)
    plan = plan_balance(seq_lens=lengths, dp_size=2, max_token_len_per_gpu=1000, workload=FLOPS_7B)
    assert_cap_and_count(plan, lengths, 2, 1, 1000)
    assert plan.num_micro_batches == 5


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dp_size=st.integers(1, 8),
    sp_size=st.integers(1, 2),
    rows_per_rank=st.integers(1, 40),
    sigma=st.floats(0.3, 1.6),
    cap_per_gpu=st.sampled_from([1024, 2048, 4096]),
    seed=st.integers(0, 2**16),
    flops=st.booleans(),
)
# A refined cost split left one rank 7 micro-batches where the reference's split packs into 6.
@example(dp_size=2, sp_size=1, rows_per_rank=9, sigma=0.875, cap_per_gpu=1024, seed=441, flops=False)
def test_micro_batch_count_never_above_two_stage_reference(
    dp_size, sp_size, rows_per_rank, sigma, cap_per_gpu, seed, flops
):
    lengths = heavy_tailed(dp_size * rows_per_rank, cap_per_gpu * sp_size, seed, sigma)
    plan = plan_balance(
        seq_lens=lengths,
        dp_size=dp_size,
        sp_size=sp_size,
        max_token_len_per_gpu=cap_per_gpu,
        workload=FLOPS_7B if flops else None,
    )
    assert_cap_and_count(plan, lengths, dp_size, sp_size, cap_per_gpu)
    np.testing.assert_array_equal(np.sort(plan.order), np.arange(len(lengths)))
    assert len({len(plan.rank_indices(r)) for r in range(dp_size)}) == 1


def test_reference_counts_a_hand_worked_packing():
    # Negative control for the reference itself: 2 ranks, cap 10, lengths 6,6,5,5,4,4 -> ranks
    # {6,5,4} and {6,5,4}; FFD per rank: [6,4], [5] -> 2 micro-batches; one rank: [6,4], [6,4], [5,5].
    assert reference_two_stage_count(np.array([6, 6, 5, 5, 4, 4]), 2, 10) == 2
    assert reference_two_stage_count(np.array([6, 6, 5, 5, 4, 4]), 1, 10) == 3
