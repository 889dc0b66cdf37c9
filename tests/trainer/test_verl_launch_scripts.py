"""verl's own gsm8k launch scripts, scaled down, run 2 steps on CPU through ``main_grpo``.

The override lists of verl's ``examples/grpo_trainer/run_qwen3_8b_fsdp.sh`` (GRPO) and
``examples/ppo_trainer/run_qwen3_8b_fsdp.sh`` (PPO with a critic) are read from
tests/data/verl_example_overrides/ and given to ``python -m verl_balance.main_grpo`` (run in this
process on the session's Ray cluster) with only these replaced: the model paths (a tiny random
Qwen2), the data files (a tiny gsm8k-shaped parquet, tests/data/gsm8k_tiny.py), the batch sizes and
lengths, ``trainer.n_gpus_per_node``, and ``rollout.name=vllm`` (no vLLM here: our ``hf`` rollout,
the one for an HF model directory). Added: ``trainer.device=cpu``, 2 training steps, the run
directory. Like verl's, the scripts pass no reward function: ``data_source="openai/gsm8k"`` is scored
by the built-in rule (``verl_balance.rewards.gsm8k``). Every other override is verl's, unchanged.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.data.gsm8k_tiny import write_gsm8k_parquet

DATA = Path(__file__).resolve().parents[1] / "data"
NO_EFFECT_PREFIX = "verl keys accepted with no effect here:"


def verl_script_overrides(script: str) -> list[str]:
    """The overrides verl's example ``script`` passes (tests/data/verl_example_overrides/)."""
    lines = (DATA / "verl_example_overrides" / f"{script}.txt").read_text().splitlines()
    return [line for line in lines if line and not line.startswith("#")]


def scaled_down(script: str, *, model: str, train: str, val: str, run_dir: Path) -> list[str]:
    """verl's overrides of ``script`` with the model, data, sizes and device scaled down."""
    replaced = {
        "data.train_files": train,
        "data.val_files": val,
        "data.train_batch_size": "2",
        "data.max_prompt_length": "160",
        "data.max_response_length": "12",
        "actor_rollout_ref.model.path": model,
        "critic.model.path": model,
        "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
        "actor_rollout_ref.rollout.name": "hf",
        "trainer.n_gpus_per_node": "2",
    }
    lines = verl_script_overrides(script)
    kept = [line for line in lines if line.partition("=")[0] not in replaced]
    present = {line.partition("=")[0] for line in lines}
    assert present >= {"data.train_files", "actor_rollout_ref.model.path", "trainer.n_gpus_per_node"}
    return [
        *kept,
        *(f"{key}={value}" for key, value in replaced.items() if key in present),
        "trainer.device=cpu",
        "trainer.total_training_steps=2",
        "trainer.resume_mode=disable",
        "trainer.plot=false",
        f"trainer.default_local_dir={run_dir}",
    ]


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("gsm8k")
    train = write_gsm8k_parquet(str(root / "train.parquet"), count=16, split="train")
    val = write_gsm8k_parquet(str(root / "test.parquet"), count=4, split="test", seed=1)
    return train, val


def launch(script: str, *, model, files, tmp_path, monkeypatch, capsys) -> tuple[list[dict], str]:
    """``main_grpo`` with ``script``'s scaled-down overrides: (metrics records, stdout)."""
    import logging
    import runpy

    from verl_balance.utils.tracking import read_metrics

    run_dir = tmp_path / "run"
    args = scaled_down(script, model=model, train=files[0], val=files[1], run_dir=run_dir)
    monkeypatch.setattr("sys.argv", ["main_grpo", *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    capsys.readouterr()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        runpy.run_module("verl_balance.main_grpo", run_name="__main__")
    finally:
        root.handlers[:] = handlers  # Hydra points them at this test's captured streams
        root.setLevel(level)
    return read_metrics(str(run_dir)), capsys.readouterr().out


def train_steps(records: list[dict]) -> list[dict]:
    return [r for r in records if r["step"] >= 1 and "actor/pg_loss" in r]


def assert_finite(record: dict, keys: list[str]) -> None:
    for key in keys:
        assert key in record and math.isfinite(record[key]), (key, record.get(key))


# What verl 0.9.1's RayPPOTrainer logs each step (trainer/ppo/metric_utils.py compute_data_metrics,
# compute_timing_metrics, compute_throughout_metrics; the actor's losses), written out here as the
# reference a verl user's dashboard reads: every one must be in a main_grpo step record.
VERL_STEP_METRICS = (
    *(f"critic/{group}/{stat}" for group in ("score", "rewards", "advantages") for stat in ("mean", "max", "min")),
    *(f"{group}/{stat}" for group in ("response_length", "prompt_length") for stat in ("mean", "max", "min")),
    "response_length/clip_ratio",
    "prompt_length/clip_ratio",
    # timing_s/old_log_prob only where the pass runs (these on-policy updates skip it: README, GRPO)
    *(f"timing_s/{phase}" for phase in ("gen", "reward", "adv", "update_actor", "step")),
    "perf/total_num_tokens",
    "perf/time_per_step",
    "perf/throughput",
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/grad_norm",
    "actor/lr",
    "training/epoch",
)
VERL_PPO_METRICS = ("critic/values/mean", "critic/returns/mean", "critic/vf_explained_var", "timing_s/values")


def no_effect_keys(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(NO_EFFECT_PREFIX)]
    assert len(lines) == 1, stdout[-2000:]
    return lines[0]


@pytest.mark.slow
def test_verl_gsm8k_grpo_script_runs_two_steps_through_main_grpo(
    ray_cluster, tiny_qwen2, gsm8k_files, tmp_path, monkeypatch, capsys
):
    records, stdout = launch(
        "grpo_trainer__run_qwen3_8b_fsdp",
        model=tiny_qwen2,
        files=gsm8k_files,
        tmp_path=tmp_path,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    steps = train_steps(records)
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert_finite(record, ["actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "critic/score/mean"])
        assert_finite(record, [*VERL_STEP_METRICS, "actor/entropy", "timing_s/ref"])  # verl's use_kl_loss=True
        assert record["actor/num_sequences"] == 2 * 5  # data.train_batch_size=2 x verl's rollout.n=5
        assert "reward/mean" not in record and "actor/kl" not in record  # our former names are gone
    # verl's validation names: val-core/<data_source>/acc/mean@<val_kwargs.n> (the gsm8k rule returns acc),
    # the score beside it under val-aux.
    assert_finite(records[-1], ["val-core/openai/gsm8k/acc/mean@1", "val-aux/openai/gsm8k/reward/mean@1"])
    line = no_effect_keys(stdout)
    for key in (
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.ref.fsdp_config.param_offload",
    ):
        assert key in line


@pytest.mark.slow
def test_verl_gsm8k_ppo_script_trains_its_critic_two_steps_through_main_grpo(
    ray_cluster, tiny_qwen2, gsm8k_files, tmp_path, monkeypatch, capsys
):
    records, stdout = launch(
        "ppo_trainer__run_qwen3_8b_fsdp",
        model=tiny_qwen2,
        files=gsm8k_files,
        tmp_path=tmp_path,
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    steps = train_steps(records)
    assert [r["step"] for r in steps] == [1, 2]
    for record in steps:
        assert_finite(record, ["actor/pg_loss", "critic/score/mean", "critic/vf_loss", "critic/grad_norm"])
        assert_finite(record, [*VERL_STEP_METRICS, *VERL_PPO_METRICS, "timing_s/update_critic"])
        assert record["critic/num_optimizer_steps"] >= 1  # trainer.critic_warmup=0: trained every step
        assert record["critic/grad_norm"] > 0
        assert record["actor/num_sequences"] == 2  # verl's rollout.n=1
    assert steps[0]["critic/vf_loss"] != steps[1]["critic/vf_loss"]
    line = no_effect_keys(stdout)
    for key in ("actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.ref.fsdp_config.param_offload"):
        assert key in line
