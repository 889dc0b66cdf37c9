"""The trainers run the model-directory checks before Ray starts: a broken directory fails at once,
naming the file (or the key), and the explicit ``custom_chat_template=builtin`` opt-in trains."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.trainer.conftest import compose_config
from verl_balance.models.tiny_hf import write_tiny_model
from verl_balance.trainer.config import ConfigError


@pytest.fixture(scope="module")
def intact_dir(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("startup") / "qwen2"), family="qwen2")


@pytest.fixture
def model_dir(intact_dir, tmp_path) -> str:
    return shutil.copytree(intact_dir, tmp_path / "model").as_posix()


@pytest.fixture
def no_ray(monkeypatch):
    """Fail the test if the trainer gets as far as starting Ray."""
    from verl_balance.trainer import cluster

    def forbidden(**kwargs):
        raise AssertionError("Ray was started before the model directory was checked")

    monkeypatch.setattr(cluster, "start_ray", forbidden)


def _chat_file(tmp_path) -> str:
    path = tmp_path / "chats.jsonl"
    with open(path, "w") as f:
        for i in range(32):
            chat = [{"role": "user", "content": f"copy {i}"}, {"role": "assistant", "content": f"{i} {i}"}]
            f.write(json.dumps({"messages": chat}) + "\n")
    return str(path)


def _overrides(model_dir, tmp_path, *extra) -> list[str]:
    return [
        "trainer.device=cpu",
        f"model.path={model_dir}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        f"data.synthetic.out_dir={tmp_path / 'data'}",
        "data.synthetic.num_train=32",
        "data.synthetic.num_val=8",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        *extra,
    ]


@pytest.mark.parametrize("recipe", ["sft", "grpo"])
def test_truncated_weights_fail_naming_the_file_before_ray_starts(recipe, model_dir, tmp_path, no_ray):
    from verl_balance.trainer.config.grpo import register_grpo_schema
    from verl_balance.trainer.grpo.trainer import GRPOTrainer
    from verl_balance.trainer.sft_trainer import SFTTrainer

    register_grpo_schema()
    weights = os.path.join(model_dir, "model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) - 1000)
    overrides = _overrides(model_dir, tmp_path)
    if recipe == "grpo":
        overrides = [o.replace("model.path", "actor_rollout_ref.model.path") for o in overrides]
    trainer_cls = SFTTrainer if recipe == "sft" else GRPOTrainer
    with pytest.raises(ConfigError, match=rf"{weights}: truncated"):
        trainer_cls(compose_config(recipe, overrides))


def test_missing_tokenizer_file_fails_naming_it_before_ray_starts(model_dir, tmp_path, no_ray):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    os.remove(os.path.join(model_dir, "tokenizer.json"))
    with pytest.raises(ConfigError, match=r"model.tokenizer='.*model': the directory has no tokenizer vocabulary"):
        SFTTrainer(compose_config("sft", _overrides(model_dir, tmp_path)))


def test_chat_data_on_a_directory_without_chat_template_fails_naming_key_and_dir(model_dir, tmp_path, no_ray):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    os.remove(os.path.join(model_dir, "chat_template.jinja"))
    cfg = compose_config(
        "sft", _overrides(model_dir, tmp_path, f"data.train_files={_chat_file(tmp_path)}", "data.messages_key=messages")
    )
    with pytest.raises(ConfigError, match=rf"data.messages_key is set.*tokenizer '{model_dir}' has no chat template"):
        SFTTrainer(cfg)


@pytest.mark.slow
def test_builtin_chat_template_opt_in_trains_on_a_directory_without_one(ray_cluster, model_dir, tmp_path, caplog):
    from tests.trainer.conftest import train_sft

    os.remove(os.path.join(model_dir, "chat_template.jinja"))
    overrides = _overrides(
        model_dir,
        tmp_path,
        f"data.train_files={_chat_file(tmp_path)}",
        "data.messages_key=messages",
        "model.custom_chat_template=builtin",
        "trainer.n_gpus_per_node=2",
        "data.train_batch_size=8",
        "trainer.total_training_steps=2",
    )
    with caplog.at_level("WARNING"):
        records = train_sft(overrides)
    assert "model.custom_chat_template=builtin: rendering chats with the built-in template" in caplog.text
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 2 and np.all(np.isfinite(losses))


# ---------------------------------------------------------------------- data.messages_key, verl's default
def _write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _pair_file(tmp_path) -> str:
    path = tmp_path / "pairs.parquet"
    pq.write_table(
        pa.table({"prompt": [f"copy {i}" for i in range(32)], "response": [f"{i}" for i in range(32)]}), path
    )
    return str(path)


def test_sft_default_messages_key_names_prompt_response_files_in_one_startup_line(tmp_path, caplog):
    from verl_balance.trainer.config.sft import validate_sft
    from verl_balance.trainer.sft_trainer import _chat_key

    pairs, chats = _pair_file(tmp_path), _chat_file(tmp_path)
    jsonl_pairs = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "a", "response": "b"}])
    overrides = [f"data.train_files=[{pairs},{jsonl_pairs}]", f"data.val_files={pairs}"]
    data = validate_sft(compose_config("sft", overrides)).data
    with caplog.at_level("INFO", logger="verl_balance.trainer.sft_trainer"):
        assert _chat_key(data) is None
    lines = [r.getMessage() for r in caplog.records if "data.messages_key is unset" in r.getMessage()]
    assert lines == [
        f"data.messages_key is unset and {pairs}, {jsonl_pairs} have no 'messages' column: training prompt/response "
        "from data.prompt_key='prompt' / data.response_key='response'"
    ]
    caplog.clear()
    # Negative controls: chat files (or the synthetic task's) are rendered as chats, and say nothing.
    data = validate_sft(compose_config("sft", [f"data.train_files={chats}"])).data
    with caplog.at_level("INFO", logger="verl_balance.trainer.sft_trainer"):
        assert _chat_key(data) == "data.messages_key=messages (verl's default)"
        assert _chat_key(validate_sft(compose_config("sft", [])).data) == "data.messages_key=messages (verl's default)"
    assert "data.messages_key is unset" not in caplog.text


def test_sft_set_messages_key_missing_from_the_train_file_fails_before_ray_starts(model_dir, tmp_path, no_ray):
    from verl_balance.data import DataError
    from verl_balance.trainer.sft_trainer import SFTTrainer

    pairs = _pair_file(tmp_path)
    cfg = compose_config(
        "sft", _overrides(model_dir, tmp_path, f"data.train_files={pairs}", "data.messages_key=messages")
    )
    with pytest.raises(
        DataError, match=r"data.messages_key='messages' is not a column; columns present: \['prompt', 'response'\]"
    ):
        SFTTrainer(cfg)


def test_sft_default_messages_key_needs_a_chat_template_only_for_chat_files(model_dir, tmp_path, no_ray):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    os.remove(os.path.join(model_dir, "chat_template.jinja"))
    chats = compose_config("sft", _overrides(model_dir, tmp_path, f"data.train_files={_chat_file(tmp_path)}"))
    with pytest.raises(ConfigError, match=r"data.messages_key=messages \(verl's default\) is set.*no chat template"):
        SFTTrainer(chats)
    # A prompt/response file passes the check (as before the default) and gets as far as starting Ray.
    pairs = compose_config("sft", _overrides(model_dir, tmp_path, f"data.train_files={_pair_file(tmp_path)}"))
    with pytest.raises(AssertionError, match="Ray was started"):
        SFTTrainer(pairs)
