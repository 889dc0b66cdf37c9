"""A slow reward function fails naming itself, the sample and the limit, with heartbeat lines
while it runs; a fast one gives exactly ``score_batch``'s result (negative control)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config
from verl_balance.data.tokenizer import ByteTokenizer
from verl_balance.protocol import Batch
from verl_balance.rewards import load_reward_fn, score_batch
from verl_balance.rewards.children import RewardChildren
from verl_balance.rewards.watchdog import RewardTimeoutError, score_batch_watched

SAMPLES = dict(
    data_sources=["a", "b", "c"], solutions=["1", "2", "3"], ground_truths=["1", "x", "3"], extra_infos=[None] * 3
)


def exact_match(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "length": float(len(solution_str))}


def slow_on_b(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "b":
        time.sleep(5)
    return 1.0


def test_fast_reward_gives_score_batch_result():
    watched = score_batch_watched(reward_fn=exact_match, timeout_s=5, heartbeat_s=1, **SAMPLES)
    reference = score_batch(reward_fn=exact_match, **SAMPLES)
    np.testing.assert_array_equal(watched[0], reference[0])
    assert watched[1].keys() == reference[1].keys()
    np.testing.assert_array_equal(watched[1]["length"], reference[1]["length"])


def test_slow_reward_call_times_out_naming_function_sample_and_limit(caplog):
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="verl_balance.rewards.watchdog"):
        with pytest.raises(RewardTimeoutError) as err:
            score_batch_watched(reward_fn=slow_on_b, timeout_s=1.5, heartbeat_s=0.5, **SAMPLES)
    assert time.monotonic() - start < 4  # not the 5 s the call takes
    message = str(err.value)
    name = f"{slow_on_b.__module__}.slow_on_b"
    assert f"reward function {name} did not return" in message
    assert "custom_reward_function.timeout_s=1.5 s on sample 1 (data_source 'b'" in message
    assert "1 of 3 samples scored" in message
    assert f"still waiting for reward function {name}" in caplog.text


def test_errors_of_the_reward_function_keep_their_type():
    def broken(*args):
        raise KeyError("ground_truth")

    with pytest.raises(KeyError, match="ground_truth"):
        score_batch_watched(reward_fn=broken, timeout_s=5, heartbeat_s=None, **SAMPLES)


def test_grpo_trainer_scores_with_the_configured_reward_timeout(tmp_path):
    """GRPOTrainer.score applies custom_reward_function.timeout_s and names the file's function."""
    from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo
    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    register_grpo_schema()
    reward_file = tmp_path / "slow_reward.py"
    reward_file.write_text("import time\ndef my_reward(data_source, s, gt, extra_info=None):\n    time.sleep(5)\n")
    cfg = compose_config(
        "grpo",
        [
            f"trainer.default_local_dir={tmp_path / 'run'}",
            f"custom_reward_function.path={reward_file}",
            "custom_reward_function.name=my_reward",
            "custom_reward_function.timeout_s=1",
        ],
    )
    config = validate_grpo(cfg)
    reward = config.custom_reward_function
    trainer = SimpleNamespace(
        config=config,
        tokenizer=ByteTokenizer(),
        reward_fn=load_reward_fn(reward.path, reward.name),
        reward_children=RewardChildren(),
    )
    batch = Batch.from_dict(
        tensors={
            "input_ids": torch.tensor([[104, 105, 49]]),
            "prompt_lengths": torch.tensor([2]),
            "response_lengths": torch.tensor([1]),
        },
        non_tensors={"data_source": ["x"], "ground_truth": ["1"], "extra_info": [None]},
    )
    with pytest.raises(RewardTimeoutError, match=rf"reward function my_reward of {reward_file} did not return"):
        GRPOTrainer.score(trainer, batch)
