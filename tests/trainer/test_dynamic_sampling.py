"""DAPO's dynamic sampling (algorithm.filter_groups) on hand-built rollout batches: which groups are kept
(verl's rule: population std of the metric > 0, or one response), how generation batches accumulate into
one train batch (padded, renumbered, truncated to train_batch_size prompts), and verl's error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_balance.batch_keys import INPUT_IDS_KEY, LOSS_MASK_KEY, PROMPT_INDEX_KEY, UID_KEY
from verl_balance.protocol import Batch
from verl_balance.trainer.grpo.dynamic_sampling import (
    DynamicSamplingError,
    GroupFilter,
    group_metric,
    kept_groups,
)

PAD = 99


def rollout_batch(prompts: list[int], width: int, uids: list[str]) -> Batch:
    """Two responses per prompt (prompt-major), rows of ``width`` tokens: row r is filled with r + 1."""
    index = np.repeat(np.asarray(prompts), 2)
    ids = torch.arange(1, len(index) + 1)[:, None].expand(-1, width).clone()
    return Batch.from_dict(
        tensors={INPUT_IDS_KEY: ids, LOSS_MASK_KEY: torch.ones(len(index), width)},
        non_tensors={PROMPT_INDEX_KEY: index, UID_KEY: np.repeat(np.asarray(uids), 2)},
    )


def test_a_group_is_kept_when_its_metric_varies_or_it_has_one_response():
    index = np.array([0, 0, 1, 1, 2, 3, 3])
    values = np.array([1.0, 1.0, 0.0, 1.0, 5.0, 0.5, 0.5])
    assert kept_groups(index, values).tolist() == [1, 2]


def test_two_generation_batches_fill_one_train_batch_prompt_major_renumbered_and_padded():
    kept = GroupFilter(metric="acc", train_batch_size=2, max_num_gen_batches=0, pad_token_id=PAD)
    first = rollout_batch([0, 1], width=3, uids=["a", "b"])
    # prompt 0 constant (dropped), prompt 1 varies (kept)
    assert not kept.add(first, scores=np.arange(4.0), extras={"acc": np.array([1.0, 1.0, 0.0, 1.0])})
    second = rollout_batch([0, 1, 2], width=5, uids=["c", "d", "e"])
    # prompts c and e vary, d is constant: c fills the batch, e is beyond train_batch_size
    done = kept.add(second, scores=10 + np.arange(6.0), extras={"acc": np.array([0.0, 1.0, 1.0, 1.0, 1.0, 0.0])})
    assert done and kept.metrics() == {"train/num_gen_batches": 2.0}
    batch, scores, extras = kept.result()
    assert batch[PROMPT_INDEX_KEY].tolist() == [0, 0, 1, 1]
    assert batch[UID_KEY].tolist() == ["b", "b", "c", "c"]
    assert scores.tolist() == [2.0, 3.0, 10.0, 11.0] and extras["acc"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert batch[INPUT_IDS_KEY].shape == (4, 5)
    assert batch[INPUT_IDS_KEY][0].tolist() == [3, 3, 3, PAD, PAD]  # row 2 of the first batch, padded
    assert batch[LOSS_MASK_KEY][0].tolist() == [1, 1, 1, 0, 0]


def test_max_num_gen_batches_stops_with_verls_error_and_zero_means_no_limit():
    constant = {"acc": np.ones(4)}
    limited = GroupFilter(metric="acc", train_batch_size=2, max_num_gen_batches=2, pad_token_id=PAD)
    assert not limited.add(rollout_batch([0, 1], 3, ["a", "b"]), scores=np.zeros(4), extras=constant)
    with pytest.raises(DynamicSamplingError, match=r"algorithm\.filter_groups.*max_num_gen_batches=2"):
        limited.add(rollout_batch([0, 1], 3, ["c", "d"]), scores=np.zeros(4), extras=constant)
    endless = GroupFilter(metric="acc", train_batch_size=2, max_num_gen_batches=0, pad_token_id=PAD)
    for _ in range(5):
        assert not endless.add(rollout_batch([0, 1], 3, ["a", "b"]), scores=np.zeros(4), extras=constant)


def test_the_metric_is_the_score_or_a_reward_field_and_a_missing_field_names_the_key():
    scores, extras = np.array([1.0, 2.0]), {"acc": np.array([0.0, 1.0])}
    for name in ("reward", "score", "seq_reward", "seq_final_reward"):
        assert group_metric(name, scores=scores, extras=extras).tolist() == [1.0, 2.0]
    assert group_metric("acc", scores=scores, extras=extras).tolist() == [0.0, 1.0]
    with pytest.raises(ValueError, match=r"algorithm\.filter_groups\.metric='format'.*\['acc'\]"):
        group_metric("format", scores=scores, extras=extras)
