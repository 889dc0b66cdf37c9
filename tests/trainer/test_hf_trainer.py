"""The trainers with a local Hugging Face model (``model.path``): start-up checks, SFT on dp=2 x sp=2,
exact resume, the ``trainer.save_hf_model`` export, and GRPO end to end.

Every model is the tiny random directory of ``models.tiny_hf`` (nothing is downloaded). References
are independent of the code under test: loss decrease is judged against the first step, resume
against an uninterrupted run of the same config, and the exported directory against the trained
weights read back from the sharded DCP checkpoint by a second code path (``export.load_checkpoint_model_state``).
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config, hf_sft_overrides, straight_and_resumed_runs
from verl_balance.trainer.config import ConfigError, validate_sft
from verl_balance.utils.tracking import read_metrics


def _sft_overrides(model_dir: str, root) -> list[str]:
    return hf_sft_overrides(model_dir, root, lr=3e-3)


# ---------------------------------------------------------------------- start-up checks (no Ray)
def _write_config(directory, model_type: str) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({"model_type": model_type}, f)
    return str(directory)


@pytest.mark.parametrize("key", ["model.path", "model.partial_pretrain"])
def test_unsupported_model_type_fails_at_startup_naming_key_and_families(tmp_path, key):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    gpt2 = _write_config(tmp_path / "gpt2", "gpt2")
    cfg = compose_config("sft", [f"{key}={gpt2}", f"trainer.default_local_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError) as err:
        SFTTrainer(cfg)
    message = str(err.value)
    assert "model.path=" in message and "'gpt2'" in message
    for family in ("llama", "qwen2", "qwen3", "mistral"):
        assert family in message


def test_supported_model_type_passes_the_startup_check(tmp_path, tiny_qwen2):
    """Negative control of the test above: a supported directory is accepted by the same check."""
    config = validate_sft(
        compose_config("sft", [f"model.path={tiny_qwen2}", f"trainer.default_local_dir={tmp_path / 'run'}"])
    )
    assert config.model.path == tiny_qwen2
    assert config.model.tokenizer_path == tiny_qwen2  # the tokenizer defaults to the model directory
    model_config = config.model.model_config(vocab_size=10)
    assert (model_config.model_type, model_config.path) == ("qwen2", tiny_qwen2)


@pytest.mark.parametrize("recipe,key", [("sft", "model.path"), ("grpo", "actor_rollout_ref.model.path")])
def test_missing_model_directory_fails_at_startup_naming_the_key(tmp_path, recipe, key):
    from verl_balance.trainer.config.grpo import register_grpo_schema
    from verl_balance.trainer.grpo.trainer import GRPOTrainer
    from verl_balance.trainer.sft_trainer import SFTTrainer

    register_grpo_schema()
    trainer_cls = SFTTrainer if recipe == "sft" else GRPOTrainer
    cfg = compose_config(recipe, [f"{key}={tmp_path / 'no_such_model'}", f"trainer.default_local_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=rf"{key}='.*no_such_model' is not a local Hugging Face directory"):
        trainer_cls(cfg)


def test_bad_tokenizer_fails_at_startup_naming_the_key(tmp_path):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    cfg = compose_config(
        "sft", [f"model.tokenizer={tmp_path / 'no_such_tokenizer'}", f"trainer.default_local_dir={tmp_path / 'run'}"]
    )
    with pytest.raises(ConfigError, match=r"model.tokenizer='.*no_such_tokenizer'"):
        SFTTrainer(cfg)


def test_init_random_and_gradient_checkpointing_reach_the_hf_model_config(tmp_path, tiny_qwen2):
    config = validate_sft(
        compose_config(
            "sft",
            [
                f"model.partial_pretrain={tiny_qwen2}",
                "model.init=random",
                "model.enable_gradient_checkpointing=true",
                f"trainer.default_local_dir={tmp_path / 'run'}",
            ],
        )
    )
    model_config = config.model.model_config(vocab_size=10)
    assert (model_config.path, model_config.init, model_config.enable_gradient_checkpointing) == (
        tiny_qwen2,
        "random",
        True,
    )


def test_partial_pretrain_and_path_that_disagree_are_rejected(tmp_path, tiny_qwen2):
    cfg = compose_config(
        "sft",
        [
            f"model.path={tiny_qwen2}",
            f"model.partial_pretrain={tmp_path}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ],
    )
    with pytest.raises(ConfigError, match="model.path=.* and model.partial_pretrain=.* disagree"):
        validate_sft(cfg)


def test_hf_only_keys_on_a_builtin_preset_fail_naming_the_key(tmp_path):
    config = validate_sft(compose_config("sft", ["model.init=random", f"trainer.default_local_dir={tmp_path / 'run'}"]))
    with pytest.raises(ConfigError, match="model.init does not apply to the built-in"):
        config.model.model_config(vocab_size=260)


def test_gradient_checkpointing_reaches_a_builtin_preset(tmp_path):
    config = validate_sft(
        compose_config(
            "sft", ["model.enable_gradient_checkpointing=true", f"trainer.default_local_dir={tmp_path / 'run'}"]
        )
    )
    assert config.model.model_config(vocab_size=260).enable_gradient_checkpointing


def test_grpo_model_path_to_a_checkpoint_is_refused_naming_warm_start_path(tmp_path):
    # The old spelling (a checkpoint as model.path, read as the warm start) is removed: it fails
    # naming the key that starts from a checkpoint's weights.
    from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo

    register_grpo_schema()
    checkpoint = tmp_path / "global_step_3"
    checkpoint.mkdir()
    (checkpoint / "trainer_state.json").write_text('{"global_step": 3}')
    run = f"trainer.default_local_dir={tmp_path / 'run'}"
    with pytest.raises(
        ConfigError,
        match=r"actor_rollout_ref.model.path=.* is a training checkpoint .*"
        r"actor_rollout_ref.model.warm_start_path",
    ):
        validate_grpo(compose_config("grpo", [f"actor_rollout_ref.model.path={checkpoint}", run]))
    # Negative control: the same checkpoint under warm_start_path is the warm start.
    config = validate_grpo(compose_config("grpo", [f"actor_rollout_ref.model.warm_start_path={checkpoint}", run]))
    assert (config.actor_rollout_ref.model.path, config.actor_rollout_ref.model.warm_start_path) == (
        None,
        str(checkpoint),
    )


# ---------------------------------------------------------------------- SFT runs (Ray)
@pytest.mark.slow
def test_hf_sft_on_dp2_sp2_lowers_the_loss_and_names_the_model(ray_cluster, tiny_qwen2, tmp_path, caplog):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    cfg = compose_config(
        "sft",
        _sft_overrides(tiny_qwen2, tmp_path)
        + [
            "trainer.n_gpus_per_node=4",
            "ulysses_sequence_parallel_size=2",
            "trainer.total_training_steps=6",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.resume_mode=disable",
        ],
    )
    with caplog.at_level(logging.INFO):
        trainer = SFTTrainer(cfg)
    try:
        ranks = trainer.actor.describe()
        trainer.fit()
    finally:
        trainer.close()
    assert f"model_type=qwen2 from {tiny_qwen2}" in caplog.text  # the start-up line
    assert [(r["dp"], r["sp"]) for r in ranks] == [(2, 2)] * 4
    assert all(r["model"]["model_type"] == "qwen2" and r["model"]["path"] == tiny_qwen2 for r in ranks)
    losses = [r["train/loss"] for r in read_metrics(os.path.join(tmp_path / "run", "metrics.jsonl"))]
    assert len(losses) == 6 and np.all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.3, losses


@pytest.fixture(scope="module")
def hf_resume_runs(ray_cluster, tiny_qwen2, tmp_path_factory):
    """An uninterrupted 4-step run (checkpoints with HF export at steps 2 and 4) and the same run
    stopped by Ctrl-C after step 2 and resumed automatically."""
    root = tmp_path_factory.mktemp("hf_resume")
    base = _sft_overrides(tiny_qwen2, root) + [
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.save_hf_model=true",
    ]
    return straight_and_resumed_runs(base, root)


@pytest.mark.slow
def test_hf_resume_after_ctrl_c_continues_the_curve_exactly(hf_resume_runs):
    runs = hf_resume_runs
    assert [r["step"] for r in runs["first"]] == [1, 2], "Ctrl-C must stop after the current step"
    assert [r["step"] for r in runs["resumed"]] == [1, 2, 3, 4]
    for key in ("train/loss", "train/grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in runs["resumed"]], [r[key] for r in runs["straight"]], rtol=1e-6, err_msg=key
        )
    # Negative control: the steps after the resume point differ from each other (the curve moves).
    assert runs["straight"][2]["train/loss"] != pytest.approx(runs["straight"][3]["train/loss"], rel=1e-6)


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


@pytest.mark.slow
def test_save_hf_model_export_reloads_with_the_trained_logits(hf_resume_runs, tiny_qwen2):
    from dataclasses import replace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_balance.export import export_checkpoint, load_checkpoint_model_state
    from verl_balance.models.hf import HFModelConfig, build_hf_model

    checkpoint = hf_resume_runs["root"] / "straight" / "global_step_4"
    exported = AutoModelForCausalLM.from_pretrained(checkpoint / "hf", local_files_only=True, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(checkpoint / "hf", local_files_only=True).chat_template
    # Reference: the trained weights read from the sharded DCP checkpoint (a second code path).
    config = HFModelConfig.from_pretrained(tiny_qwen2)
    reference = build_hf_model(replace(config, init="random"))
    state = load_checkpoint_model_state(str(checkpoint), model_config=config)
    reference.load_state_dict(state, strict=not config.tie_word_embeddings)
    input_ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(exported, input_ids), _logits(reference, input_ids), rtol=0, atol=0)
    # Negative control: training moved the weights, so the initial model's logits differ.
    initial = AutoModelForCausalLM.from_pretrained(tiny_qwen2, local_files_only=True, dtype=torch.float32)
    assert not torch.allclose(_logits(initial, input_ids), _logits(exported, input_ids), atol=1e-4)
    # The CLI path needs no --model-path: the checkpoint records its model config.
    out = export_checkpoint(str(checkpoint), str(hf_resume_runs["root"] / "cli_export"))
    again = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    torch.testing.assert_close(_logits(again, input_ids), _logits(reference, input_ids), rtol=0, atol=0)


# ---------------------------------------------------------------------- GRPO (Ray)
@pytest.mark.slow
def test_hf_grpo_runs_two_steps_end_to_end(hf_grpo_runs):
    """The full fine-tuning run of the shared HF GRPO runs (tests/trainer/conftest.py: tiny qwen2,
    2 workers, mini-batches of 2 of 4 prompts, KL loss, validation at step 2)."""
    records = hf_grpo_runs["full"]
    train = [r for r in records if "critic/score/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean"):
            assert np.isfinite(r[key]), key
        assert r["response_length/mean"] > 0
        assert r["actor/num_optimizer_steps"] == 2
    assert "val/acc" in records[-1]


@pytest.mark.slow
def test_save_hf_model_writes_a_builtin_model_as_llama_with_its_logits(sft_reference_runs, tmp_path):
    """The built-in preset exports as transformers' Llama (same math) from the same staged save
    (the shared reference run of the tiny preset, saved with trainer.save_hf_model=true)."""
    from transformers import AutoModelForCausalLM

    from verl_balance.export import export_checkpoint, load_checkpoint_model_state, recorded_model_config
    from verl_balance.models import LlamaForCausalLM, ModelConfig

    assert "trainer.save_hf_model=true" in sft_reference_runs["base"]
    checkpoint = str(sft_reference_runs["root"] / "straight" / "global_step_4")
    recorded = recorded_model_config(checkpoint)
    assert recorded["kind"] == "builtin"
    config = ModelConfig(**{k: v for k, v in recorded.items() if k != "kind"})
    reference = LlamaForCausalLM(config)
    reference.load_state_dict(load_checkpoint_model_state(checkpoint, model_config=config))
    input_ids = torch.randint(0, config.vocab_size, (20,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(
            input_ids=input_ids,
            position_ids=torch.arange(20),
            cu_seqlens=torch.tensor([0, 20], dtype=torch.int32),
            max_seqlen=20,
        )
    for directory in (os.path.join(checkpoint, "hf"), export_checkpoint(checkpoint, str(tmp_path / "cli"))):
        exported = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, dtype=torch.float32)
        assert exported.config.model_type == "llama"
        torch.testing.assert_close(_logits(exported, input_ids[None])[0], expected, rtol=1e-5, atol=1e-5)
