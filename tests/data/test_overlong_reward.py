"""DAPO's overlong reward shaping against verl 0.9.1's own dapo reward manager, and a hand-worked example."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.rewards.overlong import OverlongBufferConfig, overlong_penalty, shape_scores

MAX_LEN, PROMPT = 10, 3


def _score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str.split()) % 3)


class _Tokenizer:
    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(int(i)) for i in ids)


def test_shaped_scores_equal_verls_dapo_reward_manager():
    dapo = pytest.importorskip("verl.workers.reward_manager.dapo", reason=VERL_SKIP_REASON)
    from omegaconf import OmegaConf
    from verl import DataProto

    lengths = np.array([1, 5, 6, 7, 8, 10])
    rows = len(lengths)
    attention = torch.zeros(rows, PROMPT + MAX_LEN, dtype=torch.long)
    attention[:, :PROMPT] = 1
    for i, n in enumerate(lengths):
        attention[i, PROMPT : PROMPT + n] = 1
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.ones(rows, PROMPT, dtype=torch.long),
            "responses": torch.arange(rows * MAX_LEN).reshape(rows, MAX_LEN),
            "attention_mask": attention,
        },
        non_tensors={
            "data_source": np.array(["x"] * rows, dtype=object),
            "reward_model": np.array([{"ground_truth": "1"} for _ in range(rows)], dtype=object),
        },
    )
    config = OverlongBufferConfig(enable=True, len=4, penalty_factor=0.7, log=True)
    manager = dapo.DAPORewardManager(
        tokenizer=_Tokenizer(),
        num_examine=0,
        compute_score=_score,
        max_resp_len=MAX_LEN,
        overlong_buffer_cfg=OmegaConf.create(vars(config)),
    )
    want = manager(data, return_dict=True)
    base = np.array([_score("x", " ".join(["t"] * n), "1") for n in lengths])
    scores, extras = shape_scores(base, {}, response_lengths=lengths, max_resp_len=MAX_LEN, config=config)
    np.testing.assert_allclose(scores, want["reward_tensor"].sum(-1).numpy(), rtol=1e-6)
    theirs = [float(v) for v in want["reward_extra_info"]["overlong_reward"]]
    np.testing.assert_allclose(extras["overlong_reward"], theirs, rtol=1e-6)
    assert extras["overlong"].tolist() == [float(v) for v in want["reward_extra_info"]["overlong"]]
    assert (extras["overlong_reward"] < 0).any() and (extras["overlong_reward"] == 0).any()


def test_hand_worked_penalty_is_zero_before_the_buffer_and_linear_inside_it():
    config = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    # expected length 10 - 4 = 6: lengths 6 -> 0, 8 -> -2/4, 10 -> -1
    assert overlong_penalty([3, 6, 8, 10], max_resp_len=10, config=config).tolist() == [0.0, 0.0, -0.5, -1.0]
    scores, extras = shape_scores(
        np.array([1.0, 1.0]), {"acc": np.ones(2)}, response_lengths=[3, 10], max_resp_len=10, config=config
    )
    assert scores.tolist() == [1.0, 0.0] and set(extras) == {"acc"}  # log=false: nothing added
    off, _ = shape_scores(np.array([1.0]), {}, response_lengths=[10], max_resp_len=10, config=OverlongBufferConfig())
    assert off.tolist() == [1.0]  # negative control: the buffer off leaves the score


def test_bad_buffer_settings_name_the_key():
    with pytest.raises(ValueError, match=r"len=0 must be > 0"):
        OverlongBufferConfig(enable=True, len=0)
    with pytest.raises(ValueError, match=r"max_resp_len=3 must be >= overlong_buffer len=4"):
        overlong_penalty([1], max_resp_len=3, config=OverlongBufferConfig(enable=True, len=4))
