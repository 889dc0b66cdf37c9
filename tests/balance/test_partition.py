"""balanced_partition and the cell refinement against brute force on tiny inputs."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_balance.balance import balanced_partition, plan_balance
from verl_balance.balance.partition import descending_order, greedy_count_split

# Stated quality factors, checked below against exhaustive search:
DP_FACTOR = 4 / 3  # max part / optimal max part, equal or free counts (the classic LPT factor)
SYNC_FACTOR = 4 / 3  # sync cost / optimal sync cost, fixed micro_batch_size


def _brute_force_max_part(costs, k, equal_size):
    n, best = len(costs), np.inf
    for labels in itertools.product(range(k), repeat=n):
        counts = np.bincount(labels, minlength=k)
        if equal_size and counts.max() - counts.min() > 1:
            continue
        best = min(best, np.bincount(labels, weights=costs, minlength=k).max())
    return best


@settings(max_examples=120, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=2, max_size=8), st.integers(2, 3), st.booleans())
def test_partition_within_factor_of_brute_force_optimum(costs, k, equal_size):
    costs = np.array(costs, dtype=np.float64)
    if equal_size and len(costs) < k:
        return
    parts = balanced_partition(costs=costs, num_parts=k, equal_size=equal_size)
    ours = max(costs[p].sum() for p in parts)
    assert ours <= DP_FACTOR * _brute_force_max_part(costs, k, equal_size) + 1e-9


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=300), st.integers(1, 40), st.booleans())
def test_partition_assigns_every_item_once_with_equal_counts(costs, k, equal_size):
    costs = np.array(costs, dtype=np.float64)
    parts = balanced_partition(costs=costs, num_parts=k, equal_size=equal_size)
    assert len(parts) == k
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(costs)))
    if equal_size:
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=300), st.integers(1, 40), st.booleans())
def test_greedy_count_split_assigns_every_item_once_within_the_count_room(sizes, k, equal_size):
    parts = greedy_count_split(np.array(sizes), k, equal_size=equal_size)
    assert len(parts) == k
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(sizes)))
    counts = [len(p) for p in parts]
    assert max(counts) <= -(-len(sizes) // k)
    if equal_size:
        assert max(counts) - min(counts) <= 1


def test_greedy_count_split_is_longest_first_to_the_lightest_part_with_room():
    # 6, 6 -> parts 0, 1; 5 -> 0 (tie: the lower part); 5 -> 1; 4 -> 0 (tie at 11); 4 -> 1.
    parts = greedy_count_split(np.array([6, 6, 5, 5, 4, 4]), 2)
    assert [p.tolist() for p in parts] == [[0, 2, 4], [1, 3, 5]]
    # Count room (2 each): 10 takes part 0, two 1s fill part 1, the last 1 goes to part 0.
    assert [p.tolist() for p in greedy_count_split(np.array([10, 1, 1, 1]), 2)] == [[0, 3], [1, 2]]


def _brute_force_sync_cost(costs, dp, mbs):
    """Optimal sum_j max_d over all placements with equal per-rank counts and fixed micro size."""
    n = len(costs)
    per_rank = n // dp
    num_micro = -(-per_rank // mbs)
    best = np.inf
    for perm in itertools.permutations(range(n)):
        grid = np.zeros((dp, num_micro))
        for pos, item in enumerate(perm):
            rank, within = divmod(pos, per_rank)
            grid[rank, within // mbs] += costs[item]
        best = min(best, grid.max(axis=0).sum())
    return best


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([(2, 1), (2, 2), (3, 1), (2, 3)]), st.data())
def test_sync_cost_within_factor_of_brute_force_optimum(layout, data):
    dp, mbs = layout
    n = dp * data.draw(st.integers(1, 6 // dp))
    costs = np.array(data.draw(st.lists(st.integers(1, 100), min_size=n, max_size=n)), dtype=np.float64)
    plan = plan_balance(seq_lens=costs.astype(np.int64), dp_size=dp, micro_batch_size=mbs)
    assert plan.stats["sync_cost"] <= SYNC_FACTOR * _brute_force_sync_cost(costs, dp, mbs) + 1e-9


def test_refinement_reaches_the_tolerance_on_a_large_equal_count_split():
    rng = np.random.default_rng(0)
    costs = np.clip(np.round(rng.lognormal(np.log(1000), 1.0, 32768)), 16, 32768)
    parts = balanced_partition(costs=costs, num_parts=128, equal_size=True)
    loads = np.array([costs[p].sum() for p in parts])
    assert loads.max() / loads.mean() <= 1.0001
    unrefined = balanced_partition(costs=costs, num_parts=128, equal_size=True, refine=False)
    assert max(costs[p].sum() for p in unrefined) > loads.max()  # negative control: refinement matters


def test_descending_order_breaks_ties_by_index():
    order = descending_order(np.array([3.0, 5.0, 3.0, 5.0, 0.0]))
    np.testing.assert_array_equal(order, [1, 3, 0, 2, 4])


def test_fixed_size_plan_groups_the_heaviest_rows_when_that_lowers_the_sync_cost():
    # Hand-worked (Hypothesis found it): dp=2, micro_batch_size=2, six samples. Balancing slot sums
    # deals {16,1 | 9,1} then {9 | 1}: 17 + 9 = 26. The heaviest rows together, {16,1 | 9,9} then
    # {1 | 1}: 18 + 1 = 19, the brute-force optimum.
    costs = np.array([1, 1, 1, 9, 9, 16])
    plan = plan_balance(seq_lens=costs, dp_size=2, micro_batch_size=2)
    assert _brute_force_sync_cost(costs.astype(np.float64), 2, 2) == 19.0
    assert plan.stats["sync_cost"] == 19.0
