"""Errors knowable before Ray fail before it (issues 48 item 4 and 49), naming the key: a resume
path that does not exist, a data_source without a reward rule (read from the data), a warm-start
checkpoint of another shape (read from its DCP metadata), a model directory without safetensors.
Ray's start-up is replaced by a failure: reaching it means the check did not fire, which is how
the negative controls show a valid input passes the check."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest

from tests.trainer.conftest import compose_config
from verl_balance.rewards.score import RewardError
from verl_balance.trainer import cluster
from verl_balance.trainer.config import ConfigError, validate_sft
from verl_balance.workers.actor_rollout import WarmStartError

RAY_REACHED = "Ray was started before the error"


@pytest.fixture
def no_ray(monkeypatch):
    def started(**kwargs):
        raise AssertionError(RAY_REACHED)

    monkeypatch.setattr(cluster, "start_ray", started)


def _grpo_trainer(overrides: list[str]):
    from verl_balance.trainer.config.grpo import register_grpo_schema
    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    register_grpo_schema()
    GRPOTrainer(compose_config("grpo", overrides)).close()


def _grpo_base(tmp_path) -> list[str]:
    return [
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.model.name=tiny",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "data.synthetic.num_train=8",
        "data.synthetic.num_val=4",
        f"data.synthetic.out_dir={tmp_path / 'data'}",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]


# ---------------------------------------------------------------------- resume path
def test_a_resume_path_that_does_not_exist_is_named_missing_at_config_time(tmp_path):
    overrides = ["trainer.resume_mode=resume_path", f"trainer.default_local_dir={tmp_path / 'run'}"]
    missing = tmp_path / "run" / "global_step_9"
    with pytest.raises(ConfigError, match=r"trainer\.resume_from_path=.*global_step_9' does not exist"):
        validate_sft(compose_config("sft", overrides + [f"trainer.resume_from_path={missing}"]))
    missing.mkdir(parents=True)  # negative control: an existing directory passes the config check
    validate_sft(compose_config("sft", overrides + [f"trainer.resume_from_path={missing}"]))


# ---------------------------------------------------------------------- data_source without a rule
def _prompts_file(path, data_source: str) -> str:
    rows = [
        {"data_source": "synthetic/copy", "prompt": [{"role": "user", "content": "copy: ab"}], "reward_model": {}},
        {"data_source": data_source, "prompt": [{"role": "user", "content": "say hi"}], "reward_model": {}},
    ] * 4
    for row in rows:
        row["reward_model"] = {"ground_truth": "hi"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_data_source_without_a_reward_rule_is_found_in_the_data_before_ray(tmp_path, no_ray):
    train = _prompts_file(tmp_path / "train.jsonl", "my_quiz")
    base = _grpo_base(tmp_path) + [f"data.train_files={train}"]
    with pytest.raises(RewardError, match=r"no reward rule for data_source 'my_quiz' \(.*train\.jsonl, row 1\)"):
        _grpo_trainer(base)
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with pytest.raises(AssertionError, match=RAY_REACHED):  # negative control: a custom reward scores it
        _grpo_trainer(base + [f"custom_reward_function.path={reward}"])


# ---------------------------------------------------------------------- warm start of another shape
def _dcp_checkpoint(path, model_config) -> str:
    """An engine-layout checkpoint (DCP, keys ``model.<name>``) of a model built from ``model_config``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from verl_balance.models import build_model

    state = {"model": get_model_state_dict(build_model(model_config))}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    (path / "trainer_state.json").write_text("{}")  # what makes it one of the trainers' checkpoints
    return str(path)


def test_a_warm_start_checkpoint_of_another_shape_fails_before_ray_naming_the_key(tmp_path, no_ray):
    from verl_balance.data.tokenizer import build_tokenizer
    from verl_balance.models.config import ModelConfig

    tiny = dataclasses.replace(ModelConfig.preset("tiny"), vocab_size=build_tokenizer("byte").vocab_size)
    wide = dataclasses.replace(tiny, hidden_size=2 * tiny.hidden_size)
    key = "actor_rollout_ref.model.warm_start_path"
    other = _dcp_checkpoint(tmp_path / "wide", wide)
    with pytest.raises(WarmStartError, match=rf"{key}=.*wide' does not fit a model of .*shape mismatch"):
        _grpo_trainer(_grpo_base(tmp_path) + [f"{key}={other}", "trainer.allow_unverified_checkpoint=true"])
    same = _dcp_checkpoint(tmp_path / "same", tiny)
    with pytest.raises(AssertionError, match=RAY_REACHED):  # negative control: the same shapes pass
        _grpo_trainer(_grpo_base(tmp_path) + [f"{key}={same}", "trainer.allow_unverified_checkpoint=true"])


# ---------------------------------------------------------------------- model directory without safetensors
def test_a_model_directory_with_only_pytorch_bin_fails_before_ray_naming_the_key(tmp_path, tiny_qwen2, no_ray):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2, model)
    weights = model / "model.safetensors"
    os.replace(weights, model / "pytorch_model.bin")
    overrides = [
        f"model.path={model}",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "data.train_batch_size=4",
        "data.synthetic.num_train=8",
        "data.synthetic.num_val=4",
        f"data.synthetic.out_dir={tmp_path / 'data'}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    with pytest.raises(ConfigError, match=r"model\.path=.* has only pytorch_model\*\.bin: the engine reads"):
        SFTTrainer(compose_config("sft", overrides)).close()
    os.replace(model / "pytorch_model.bin", weights)
    with pytest.raises(AssertionError, match=RAY_REACHED):  # negative control: the safetensors pass
        SFTTrainer(compose_config("sft", overrides)).close()
