"""CalibratedWorkload and the micro-batch count it buys: plan.py's module docstring, calibrated part."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_balance.balance import BalanceConfigError, plan_balance
from verl_balance.balance.workload import CalibratedWorkload, micro_batch_overhead

LINEAR = dict(sequence=0.0, token=1.0, pair=0.0)


class SameCostsNoOverhead:
    """The calibrated per-sequence costs without the fixed cost: the fewest-first planner's view."""

    def __init__(self, calibrated):
        self.calibrated = calibrated

    def cost(self, lengths):
        return self.calibrated.cost(lengths)


def paid(plan, costs, c0):
    """K * c0 + sum_j max_d (sequence costs of cell (d, j)), recomputed from the indices alone."""
    grid = np.array([[costs[mb].sum() for mb in rank] for rank in plan.micro_batches])
    return plan.num_micro_batches * c0 + float(grid.max(axis=0).sum())


def test_cost_is_the_sum_of_sequence_terms_plus_a_fixed_cost_per_micro_batch():
    w = CalibratedWorkload(micro_batch=5e-3, sequence=1e-4, token=2e-5, pair=1e-8)
    # L = 8: 1e-4 + 8 * 2e-5 + 36 * 1e-8; L = 100: 1e-4 + 100 * 2e-5 + 5050 * 1e-8
    np.testing.assert_allclose(w.cost(np.array([8, 100])), [2.6036e-4, 2.1505e-3])
    assert w.micro_batch_seconds([8, 100]) == pytest.approx(5e-3 + 2.6036e-4 + 2.1505e-3)
    assert micro_batch_overhead(w) == 5e-3 and micro_batch_overhead(object()) == 0.0


def test_calibration_file_round_trips(tmp_path):
    w = CalibratedWorkload(micro_batch=5e-3, sequence=0.0, token=2e-5, pair=1e-8, fingerprint={"model": "small"})
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**w.to_dict(), "fit": {"r2": 0.99}}))
    back = CalibratedWorkload.from_file(str(path))
    assert back == w and back.fingerprint == {"model": "small"} and back.source == str(path)


@pytest.mark.parametrize(
    "content, pattern",
    [
        (None, "does not exist"),
        ("{not json", "cannot be read as JSON"),
        ({"fingerprint": {}}, "no 'coefficients'"),
        ({"coefficients": {"micro_batch": 1e-3, "token": 1e-5}}, r"missing \['pair'\]"),
        ({"coefficients": {"micro_batch": 1e-3, "token": 1e-5, "pair": 0, "tok": 1}}, r"unknown \['tok'\]"),
        ({"coefficients": {"micro_batch": -1e-3, "token": 1e-5, "pair": 0}}, "micro_batch=-0.001"),
        ({"coefficients": {"micro_batch": 1e-3, "token": "fast", "pair": 0}}, "token='fast'"),
        ({"coefficients": {"micro_batch": 1e-3, "token": 0, "pair": 0}}, "every plan would cost the same"),
    ],
)
def test_bad_calibration_file_raises_naming_the_file_and_key(tmp_path, content, pattern):
    path = tmp_path / "cal.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(BalanceConfigError, match=pattern) as info:
        CalibratedWorkload.from_file(str(path))
    assert str(path) in str(info.value)


def test_fixed_cost_dominance_keeps_fewer_micro_batches():
    # dp 2, cap 10, cost = tokens: 35 tokens need K >= ceil(35 / 20) = 2 micro-batches per rank.
    # The fewest-first layout at K = 2 pays 2 c0 + 19; with K = 3 the planner finds 18 (rank 0: 8 | 5 | 3+2,
    # rank 1: 8 | 5 | 4 -> 8 + 5 + 5). One more micro-batch saves 1, so it is taken when c0 < 1 and
    # refused when c0 > 1: with c0 = 5 any 3-slot plan pays >= 3 * 5 + 35 / 2 = 32.5 > 2 * 5 + 19 = 29.
    lengths = np.array([5, 8, 3, 4, 2, 5, 8])
    cheap = plan_balance(
        seq_lens=lengths, dp_size=2, max_token_len_per_gpu=10, workload=CalibratedWorkload(micro_batch=1e-3, **LINEAR)
    )
    dear = plan_balance(
        seq_lens=lengths, dp_size=2, max_token_len_per_gpu=10, workload=CalibratedWorkload(micro_batch=5.0, **LINEAR)
    )
    assert cheap.num_micro_batches == 3 and cheap.stats["sync_cost"] == pytest.approx(3 * 1e-3 + 18)
    assert dear.num_micro_batches == 2 and dear.stats["sync_cost"] == pytest.approx(2 * 5.0 + 19)
    # Negative control: a workload without a fixed cost keeps the fewest-first rule (the FLOPs model's).
    no_overhead = SameCostsNoOverhead(CalibratedWorkload(micro_batch=1e-3, **LINEAR))
    flat = plan_balance(seq_lens=lengths, dp_size=2, max_token_len_per_gpu=10, workload=no_overhead)
    assert flat.num_micro_batches == 2
    for plan in (cheap, dear):
        assert max(lengths[mb].sum() for rank in plan.micro_batches for mb in rank) <= 10


def _brute_force_paid(lengths, costs, dp, cap, c0, max_slots):
    """min over K <= max_slots and every placement (cap, per-rank counts within one) of the paid cost."""
    n, best = len(lengths), np.inf
    for k in range(1, max_slots + 1):
        labels = np.array(list(itertools.product(range(dp * k), repeat=n)))  # [placements, n]
        rank = labels // k
        counts = np.stack([(rank == d).sum(axis=1) for d in range(dp)], axis=1)
        ok = counts.max(axis=1) - counts.min(axis=1) <= 1
        cell_tokens = np.zeros((len(labels), dp * k))
        cell_costs = np.zeros((len(labels), dp * k))
        for i in range(n):
            np.add.at(cell_tokens, (np.arange(len(labels)), labels[:, i]), lengths[i])
            np.add.at(cell_costs, (np.arange(len(labels)), labels[:, i]), costs[i])
        ok &= cell_tokens.max(axis=1) <= cap
        if ok.any():
            sync = cell_costs.reshape(len(labels), dp, k).max(axis=1).sum(axis=1)
            best = min(best, k * c0 + float(sync[ok].min()))
    return best


PAID_FACTOR = 4 / 3  # as the fixed-size sync cost against brute force (tests/balance/test_partition.py)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 10), min_size=2, max_size=5),
    c0=st.sampled_from([0.01, 0.5, 2.0, 20.0]),
    pair=st.sampled_from([0.0, 0.1]),
)
def test_paid_cost_within_factor_of_brute_force_optimum(lengths, c0, pair):
    lengths = np.array(lengths)
    w = CalibratedWorkload(micro_batch=c0, sequence=0.0, token=1.0, pair=pair)
    plan = plan_balance(seq_lens=lengths, dp_size=2, max_token_len_per_gpu=10, workload=w)
    ours = paid(plan, w.cost(lengths), c0)
    assert plan.stats["sync_cost"] == pytest.approx(ours)
    assert ours <= PAID_FACTOR * _brute_force_paid(lengths, w.cost(lengths), 2, 10, c0, len(lengths)) + 1e-9


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dp=st.integers(2, 6),
    lengths=st.lists(st.integers(1, 300), min_size=6, max_size=60),
    cap_extra=st.integers(0, 500),
    c0=st.floats(1e-4, 1e-2),
)
def test_paid_cost_never_above_the_fewest_first_plan_and_never_over_the_cap(dp, lengths, cap_extra, c0):
    lengths = np.array(lengths)
    cap = int(lengths.max()) + cap_extra
    w = CalibratedWorkload(micro_batch=c0, sequence=2e-5, token=1e-5, pair=5e-8)
    plan = plan_balance(seq_lens=lengths, dp_size=dp, max_token_len_per_gpu=cap, workload=w)
    fewest = plan_balance(seq_lens=lengths, dp_size=dp, max_token_len_per_gpu=cap, workload=SameCostsNoOverhead(w))
    costs = w.cost(lengths)
    assert plan.stats["sync_cost"] == pytest.approx(paid(plan, costs, c0))
    assert plan.stats["sync_cost"] <= paid(fewest, costs, c0) * (1 + 1e-9)
    assert plan.stats["lower_bound"] <= plan.stats["sync_cost"] * (1 + 1e-9)
    assert plan.num_micro_batches >= fewest.num_micro_batches
    assert max(lengths[mb].sum() for rank in plan.micro_batches for mb in rank) <= cap
    np.testing.assert_array_equal(np.sort(plan.order), np.arange(len(lengths)))


def test_fixed_micro_batch_size_keeps_the_users_count_and_size():
    lengths = np.array([8, 300, 12, 9, 250, 40, 30, 8, 8, 100, 64, 20, 10, 9, 11, 8])
    w = CalibratedWorkload(micro_batch=1.0, sequence=0.0, token=1e-5, pair=1e-7)
    plan = plan_balance(seq_lens=lengths, dp_size=2, micro_batch_size=4, workload=w)
    assert plan.num_micro_batches == 2  # ceil(8 samples per rank / 4): the fewest of at most 4 samples
    assert all(len(mb) == 4 for rank in plan.micro_batches for mb in rank)
    # Every cell pays the fixed cost: sync = 2 * c0 + sum_j max_d.
    assert plan.stats["sync_cost"] == pytest.approx(paid(plan, w.cost(lengths), 1.0))
    assert plan.stats["lower_bound"] == pytest.approx(w.cost(lengths).sum() / 2 + 2 * 1.0)
