"""main_sft with LoRA (model.lora_rank > 0) on a tiny HF model: dp=2 x sp=2 lowers the loss, a run
stopped by Ctrl-C resumes onto the uninterrupted curve exactly, and the config keys are checked
(verl's names, also in main_grpo).

References: the uninterrupted run of the same config (resume), the first step (loss decrease).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer.conftest import compose_config, hf_sft_overrides, straight_and_resumed_runs
from verl_balance.trainer.config import ConfigError, validate_sft


def _overrides(model_dir: str, root) -> list[str]:
    return hf_sft_overrides(model_dir, root, lr=2e-2) + [
        "model.lora_rank=8",
        "model.lora_alpha=16",
        "model.target_modules=all-linear",
        "trainer.n_gpus_per_node=4",
        "ulysses_sequence_parallel_size=2",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
    ]


def test_lora_keys_reach_the_engine_config(tmp_path, tiny_qwen2):
    config = validate_sft(
        compose_config(
            "sft",
            [
                f"model.path={tiny_qwen2}",
                "model.lora_rank=4",
                "model.lora_alpha=32",
                "model.target_modules=[q_proj,v_proj]",
                "model.exclude_modules=[o_proj]",
                f"trainer.default_local_dir={tmp_path / 'run'}",
            ],
        )
    )
    engine = config.engine_config(total_steps=2)
    assert (engine.lora_rank, engine.lora_alpha, list(engine.target_modules), list(engine.exclude_modules)) == (
        4,
        32,
        ["q_proj", "v_proj"],
        ["o_proj"],
    )
    # Negative control: the default is full fine-tuning.
    default = validate_sft(compose_config("sft", [f"model.path={tiny_qwen2}", f"trainer.default_local_dir={tmp_path}"]))
    assert default.engine_config(total_steps=2).lora_rank == 0


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.lora_rank=-1", "model.lora_rank"),
        ("model.lora_alpha=0", "model.lora_alpha"),
        ("model.lora_adapter_path=/x", "model.lora_adapter_path"),
    ],
)
def test_bad_lora_values_fail_naming_the_recipe_key(tmp_path, tiny_qwen2, override, key):
    rank = "model.lora_rank=0" if "adapter" in override else "model.lora_rank=4"
    overrides = [f"model.path={tiny_qwen2}", rank, override, f"trainer.default_local_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=key):  # at start-up, before any worker
        validate_sft(compose_config("sft", overrides)).engine_config(total_steps=2)


def test_lora_on_the_builtin_preset_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.lora_rank=4 needs a Hugging Face model"):
        validate_sft(compose_config("sft", ["model.lora_rank=4", f"trainer.default_local_dir={tmp_path}"]))


def test_lora_without_peft_is_refused_at_start_up_naming_the_package(tmp_path, tiny_qwen2, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real_find_spec(name, *a)
    )
    run = [f"model.path={tiny_qwen2}", f"trainer.default_local_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"model\.lora_rank=8: LoRA needs peft, which is not installed: pip install"):
        validate_sft(compose_config("sft", [*run, "model.lora_rank=8"]))
    validate_sft(compose_config("sft", [*run, "model.lora_rank=0"]))  # negative control: full fine-tuning needs no peft


def test_peft_is_a_dependency_of_the_package():
    from pathlib import Path

    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert any(dep.startswith("peft") for dep in pyproject["project"]["dependencies"])


def test_grpo_lora_keys_reach_the_engine_config(tmp_path, tiny_qwen2):
    from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo

    register_grpo_schema()
    run = f"trainer.default_local_dir={tmp_path / 'run'}"
    model = f"actor_rollout_ref.model.path={tiny_qwen2}"
    keys = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
    engine = validate_grpo(compose_config("grpo", [model, *keys, run])).engine_config(total_steps=2)
    assert (engine.lora_rank, engine.lora_alpha) == (8, 16)
    default = validate_grpo(compose_config("grpo", [model, run])).engine_config(total_steps=2)
    assert default.lora_rank == 0  # negative control: the default is full fine-tuning


@pytest.fixture(scope="module")
def lora_runs(ray_cluster, tiny_qwen2, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_resume")
    base = _overrides(tiny_qwen2, root)
    return straight_and_resumed_runs(base, root)


@pytest.mark.slow
def test_lora_sft_on_dp2_sp2_lowers_the_loss(lora_runs):
    losses = [r["train/loss"] for r in lora_runs["straight"]]
    assert len(losses) == 4 and np.all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.1, losses


@pytest.mark.slow
def test_lora_resume_after_ctrl_c_continues_the_curve_exactly(lora_runs):
    runs = lora_runs
    assert [r["step"] for r in runs["first"]] == [1, 2]
    assert [r["step"] for r in runs["resumed"]] == [1, 2, 3, 4]
    for key in ("train/loss", "train/grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in runs["resumed"]], [r[key] for r in runs["straight"]], rtol=1e-6, err_msg=key
        )
    # Negative control: the curve moves after the resume point.
    assert runs["straight"][2]["train/loss"] != pytest.approx(runs["straight"][3]["train/loss"], rel=1e-6)


@pytest.mark.slow
def test_lora_trainer_checkpoint_exports_a_peft_adapter_without_flags(lora_runs, tiny_qwen2):
    """The CLI reads the model the trainer recorded and the adapter config the engine saved."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verl_balance.export import export_checkpoint

    out = lora_runs["root"] / "adapter"
    export_checkpoint(str(lora_runs["root"] / "straight" / "global_step_4"), str(out))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    ids = torch.arange(1, 20)[None]
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
        lora_logits = PeftModel.from_pretrained(base, str(out))(input_ids=ids).logits
    assert (lora_logits - base_logits).abs().max() > 1e-4  # the trained adapters are in the export
