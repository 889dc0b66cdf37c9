"""Bad input raises a ValueError subclass that names the sample and what would be valid."""

from __future__ import annotations

import numpy as np
import pytest

from verl_balance.balance import (
    BalanceConfigError,
    EmptyBatchError,
    InvalidLengthError,
    OverlongSampleError,
    TooFewSamplesError,
    plan_balance,
)

CAP = dict(max_token_len_per_gpu=100)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(seq_lens=[], dp_size=1, **CAP), EmptyBatchError, "empty"),
        (dict(seq_lens=[1, 2], dp_size=0, **CAP), BalanceConfigError, "dp_size=0.*>= 1"),
        (dict(seq_lens=[1, 2], dp_size=1, sp_size=0, **CAP), BalanceConfigError, "sp_size=0"),
        (dict(seq_lens=[1, 2], dp_size=1), BalanceConfigError, "exactly one of micro_batch_size"),
        (dict(seq_lens=[1, 2], dp_size=1, micro_batch_size=2, **CAP), BalanceConfigError, "exactly one"),
        (dict(seq_lens=[1, 2], dp_size=1, micro_batch_size=0), BalanceConfigError, "micro_batch_size=0"),
        (dict(seq_lens=[1, -4, 2], dp_size=1, **CAP), InvalidLengthError, "sample 1 has negative length -4"),
        (dict(seq_lens=[1.5, 2], dp_size=1, **CAP), InvalidLengthError, "sample 0 has length 1.5"),
        (dict(seq_lens=[[1, 2]], dp_size=1, **CAP), InvalidLengthError, "1-D"),
        (dict(seq_lens=[1, 2, 3], dp_size=4, **CAP), TooFewSamplesError, "3 samples.*dp_size=4.*equal_size=False"),
        (dict(seq_lens=[5, 300, 7], dp_size=1, **CAP), OverlongSampleError, "sample 1 has length 300.*100"),
        (
            dict(seq_lens=[5, 150, 7], dp_size=1, sp_size=2, max_token_len_per_gpu=60),
            OverlongSampleError,
            "sample 1 has length 150.*60 \\* 2 = 120",
        ),
        (
            dict(seq_lens=[60, 60, 7, 1], dp_size=1, group_ids=[0, 0, 1, 1], **CAP),
            OverlongSampleError,
            "group of samples \\[0, 1\\] has 120 tokens",
        ),
        (dict(seq_lens=[1, 2], dp_size=1, overlong="drop", **CAP), BalanceConfigError, "overlong='drop'"),
        (dict(seq_lens=[1, 2], dp_size=1, group_scope="node", **CAP), BalanceConfigError, "group_scope='node'"),
        (dict(seq_lens=[1, 2], dp_size=1, workload="bytes", **CAP), BalanceConfigError, "workload='bytes'"),
        (
            dict(seq_lens=[1, 2, 3], dp_size=1, group_ids=[0, 0, 1], micro_batch_size=2),
            BalanceConfigError,
            "same size",
        ),
        (dict(seq_lens=[1, 2], dp_size=1, group_ids=[0], **CAP), BalanceConfigError, "one id per sample"),
        (dict(seq_lens=[300, 400], dp_size=1, overlong="skip", **CAP), EmptyBatchError, "all 2 samples"),
    ],
)
def test_bad_input_raises_a_value_error_naming_what_is_wrong(kwargs, error, pattern):
    with pytest.raises(error, match=pattern) as info:
        plan_balance(**kwargs)
    assert isinstance(info.value, ValueError)


def test_fewer_samples_than_ranks_is_fine_with_free_counts():
    plan = plan_balance(seq_lens=[4, 9], dp_size=3, max_token_len_per_gpu=10, equal_size=False)
    assert sorted(len(plan.rank_indices(r)) for r in range(3)) == [0, 1, 1]
    assert plan.num_micro_batches == 1


def test_overlong_skip_drops_and_reports_the_samples():
    lengths = np.array([10, 500, 20, 30, 700, 5])
    plan = plan_balance(seq_lens=lengths, dp_size=2, max_token_len_per_gpu=100, overlong="skip")
    np.testing.assert_array_equal(plan.skipped, [1, 4])
    kept = np.sort(np.concatenate([plan.rank_indices(r) for r in range(2)]))
    np.testing.assert_array_equal(kept, [0, 2, 3, 5])
    assert plan.stats["num_skipped"] == 2 and plan.stats["num_kept"] == 4
    np.testing.assert_array_equal(plan.order[plan.inverse_permutation], [0, 2, 3, 5])


def test_overlong_skip_drops_a_whole_group():
    plan = plan_balance(
        seq_lens=[60, 60, 7, 1], dp_size=1, group_ids=["a", "a", "b", "b"], max_token_len_per_gpu=100, overlong="skip"
    )
    np.testing.assert_array_equal(plan.skipped, [0, 1])
    assert plan.rank_indices(0).tolist() == [2, 3]


def test_overlong_truncate_reports_the_new_lengths():
    lengths = np.array([10, 500, 20, 30])
    plan = plan_balance(seq_lens=lengths, dp_size=2, sp_size=2, max_token_len_per_gpu=100, overlong="truncate")
    assert plan.truncated == {1: 200}
    assert plan.stats["num_truncated"] == 1 and plan.stats["truncated_tokens"] == 200
    assert int(plan.cell_tokens.max()) <= 200
    assert sorted(np.concatenate([plan.rank_indices(r) for r in range(2)]).tolist()) == [0, 1, 2, 3]


def test_group_longer_than_the_cap_is_fine_when_groups_only_share_a_rank():
    lengths = [60, 60, 7, 1]
    plan = plan_balance(seq_lens=lengths, dp_size=1, group_ids=[0, 0, 1, 1], group_scope="rank", **CAP)
    assert plan.num_micro_batches == 2
    assert all(np.asarray(lengths)[mb].sum() <= 100 for mb in plan.micro_batches[0])
