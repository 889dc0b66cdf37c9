"""The engine's throughput switches as the recipes expose them: FSDP2 switches under verl's
``fsdp_config`` keys, ``trainer.profile_steps`` (driver steps) mapped to engine steps, and the
engine's perf/* figures in the driver's metrics. The fast tests build configs only (no Ray); the
slow ones run a 2-worker SFT job."""

from __future__ import annotations

import dataclasses
import glob
import os

import numpy as np
import pytest
from hydra.errors import ConfigCompositionException

from tests.trainer.conftest import compose_config
from verl_balance.engine.config import FSDPConfig
from verl_balance.trainer.config import ConfigError, check_profile_steps, engine_profile_steps, validate_sft
from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo
from verl_balance.trainer.metrics import reduce_rank_metrics

register_grpo_schema()

NO_OFFLOAD = {"param_offload": False, "optimizer_offload": False, "offload_policy": False}
FAST_SWITCHES = {"reshard_after_forward": False, "reshard_after_backward": False, "defer_gradient_sync": True}
MEMORY_SAFE = {
    "reshard_after_forward": True,
    "reshard_after_backward": True,
    "defer_gradient_sync": False,
    **NO_OFFLOAD,
}


def _sft_engine(overrides: list[str]):
    config = validate_sft(compose_config("sft", overrides))
    return config, config.engine_config(total_steps=10)


def _grpo_engine(overrides: list[str], *, updates_per_step: int | None = None):
    config = validate_grpo(compose_config("grpo", overrides))
    assert updates_per_step is None or config.updates_per_step == updates_per_step
    return config, config.engine_config(total_steps=10)


# ---------------------------------------------------------------------- FSDP switches
def test_recipe_defaults_are_the_memory_safe_fsdp_config():
    _, sft = _sft_engine([])
    _, grpo = _grpo_engine([])
    assert dataclasses.asdict(sft.fsdp) == MEMORY_SAFE == dataclasses.asdict(FSDPConfig())
    assert dataclasses.asdict(grpo.fsdp) == MEMORY_SAFE
    assert (sft.profile_steps, grpo.profile_steps) == ([], [])


@pytest.mark.parametrize(
    "recipe, section", [("sft", "model.fsdp_config"), ("grpo", "actor_rollout_ref.actor.fsdp_config")]
)
def test_fsdp_config_overrides_reach_the_engine_config(recipe, section):
    overrides = [f"{section}.{k}={str(v).lower()}" for k, v in FAST_SWITCHES.items()]
    if recipe == "sft":
        _, engine = _sft_engine(overrides)
    else:
        _, engine = _grpo_engine(overrides)
    assert isinstance(engine.fsdp, FSDPConfig)
    assert dataclasses.asdict(engine.fsdp) == {**FAST_SWITCHES, **NO_OFFLOAD}
    # Each switch on its own reaches the engine alone (no switch is wired to another's key).
    for key, value in FAST_SWITCHES.items():
        single = [f"{section}.{key}={str(value).lower()}"]
        _, engine = _sft_engine(single) if recipe == "sft" else _grpo_engine(single)
        assert dataclasses.asdict(engine.fsdp) == {**MEMORY_SAFE, key: value}


@pytest.mark.parametrize(
    "recipe, override, key",
    [
        ("sft", "model.fsdp_config.reshard_after_foward=false", "reshard_after_foward"),
        ("sft", "model.fsdp_config.defer_gradient_sync=maybe", "model.fsdp_config.defer_gradient_sync"),
        (
            "grpo",
            "actor_rollout_ref.actor.fsdp_config.reshard_after_backward=sometimes",
            "actor_rollout_ref.actor.fsdp_config.reshard_after_backward",
        ),
        ("sft", "trainer.profile_steps=[two]", "trainer.profile_steps"),
    ],
)
def test_unknown_or_invalid_switch_fails_at_start_up_naming_the_key(recipe, override, key):
    # a wrong type fails as Hydra composes; an unknown key when the composed config is validated
    validate = validate_sft if recipe == "sft" else validate_grpo
    with pytest.raises((ConfigCompositionException, ConfigError)) as err:
        validate(compose_config(recipe, [override]))
    assert key in str(err.value) + str(err.value.__cause__)


@pytest.mark.parametrize("recipe", ["sft", "grpo"])
def test_profile_step_below_one_fails_naming_the_key(recipe):
    validate = validate_sft if recipe == "sft" else validate_grpo
    with pytest.raises(ConfigError, match=r"trainer\.profile_steps=\[2, 0\].*1-based"):
        validate(compose_config(recipe, ["trainer.profile_steps=[2,0]"]))


def test_profile_step_beyond_the_run_fails_naming_the_key():
    trainer = validate_sft(compose_config("sft", ["trainer.profile_steps=[3,7]"])).trainer
    check_profile_steps(trainer=trainer, total_steps=7)  # the last step is fine
    with pytest.raises(ConfigError, match=r"trainer\.profile_steps=\[3, 7\].*\[7\].*1\.\.6"):
        check_profile_steps(trainer=trainer, total_steps=6)


# ---------------------------------------------------------------------- profiler steps and directory
def test_sft_profile_steps_are_engine_steps_one_to_one(tmp_path):
    run_dir = tmp_path / "run"
    config, engine = _sft_engine(["trainer.profile_steps=[5,2]", f"trainer.default_local_dir={run_dir}"])
    assert engine.profile_steps == [2, 5]
    assert engine.profile_dir == str(run_dir / "profile") == config.trainer.profile_path


def test_profile_dir_override_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, engine = _sft_engine(["trainer.profile_steps=[1]", "trainer.profile_dir=traces"])
    assert engine.profile_dir == str(tmp_path / "traces")  # workers may run in another directory


def test_grpo_profile_step_traces_every_update_of_that_driver_step():
    # Hand-worked: 3 updates per driver step (3 epochs of one mini-batch); driver step 1 = engine
    # 1..3, step 2 = engine 4..6; the engine runs 10 driver steps x 3 updates.
    three = ["actor_rollout_ref.actor.ppo_epochs=3", "actor_rollout_ref.actor.ppo_mini_batch_size=16"]
    _, engine = _grpo_engine(["trainer.profile_steps=[2]", *three], updates_per_step=3)
    assert (engine.profile_steps, engine.total_steps) == ([4, 5, 6], 30)
    # The recipe's default: 16 prompts in mini-batches of 8, one epoch = 2 updates.
    _, engine = _grpo_engine(["trainer.profile_steps=[1,3]"], updates_per_step=2)
    assert engine.profile_steps == [1, 2, 5, 6]
    assert engine_profile_steps([4, 4], updates_per_step=1) == [4]


# ---------------------------------------------------------------------- metrics
def _rank_metrics(*, rank: int, memory_gb: float | None, busy: float) -> dict:
    m = {
        "loss": 2.5,
        "grad_norm": 0.75,
        "dp_rank": rank,
        "perf/tokens": 640.0,
        "perf/step_seconds": 0.5,
        "perf/tokens_per_s_per_device": 320.0,
        "perf/mfu": 0.41,
        "busy_seconds": busy,
        "micro_batch_busy_seconds": [busy / 2, busy / 2],
    }
    if memory_gb is not None:
        m["perf/max_memory_allocated_gb"] = memory_gb
    return m


def test_reduce_rank_metrics_logs_engine_perf_keys_unprefixed():
    per_rank = [_rank_metrics(rank=0, memory_gb=3.0, busy=1.0), _rank_metrics(rank=1, memory_gb=5.5, busy=3.0)]
    out = reduce_rank_metrics(per_rank, prefix="train/")
    assert out["perf/mfu"] == 0.41
    assert out["perf/tokens_per_s_per_device"] == 320.0
    assert out["perf/max_memory_allocated_gb"] == 5.5  # the peak over ranks, not rank 0's
    assert (out["train/loss"], out["train/grad_norm"]) == (2.5, 0.75)
    # The engine's token count must not overwrite the driver's perf/tokens (whole-step figure).
    assert "perf/tokens" not in out and out["train/perf/tokens"] == 640.0
    assert not any(k.startswith(("train/perf/mfu", "train/perf/tokens_per_s", "train/perf/max_memory")) for k in out)
    assert not any(k.endswith("seconds") or k == "train/dp_rank" for k in out)
    assert out["balance/imbalance_measured"] == pytest.approx(3.0 / 2.0)


def test_reduce_rank_metrics_without_cuda_memory_has_no_memory_key():
    out = reduce_rank_metrics([_rank_metrics(rank=r, memory_gb=None, busy=1.0) for r in range(2)], prefix="actor/")
    assert "perf/max_memory_allocated_gb" not in out
    assert out["perf/tokens_per_s_per_device"] == 320.0 and out["actor/loss"] == 2.5
    assert out["balance/imbalance_measured"] == 1.0


# ---------------------------------------------------------------------- 2-worker SFT runs (Ray)
def _sft_run(overrides: list[str]) -> tuple[list[dict], list[dict]]:
    from verl_balance.trainer.sft_trainer import SFTTrainer
    from verl_balance.utils.tracking import read_metrics

    cfg = compose_config("sft", overrides)
    trainer = SFTTrainer(cfg)
    try:
        ranks = trainer.actor.describe()
        trainer.fit()
    finally:
        trainer.close()
    return ranks, read_metrics(os.path.join(cfg.trainer.default_local_dir, "metrics.jsonl"))


@pytest.fixture(scope="module")
def fsdp_runs(ray_cluster, tmp_path_factory) -> dict:
    """The same 4-step SFT config with the default (memory-safe) FSDP switches, profiling step 2, and
    with FAST_SWITCHES: {"root", "default": (ranks, records), "fast": (ranks, records)}."""
    root = tmp_path_factory.mktemp("fsdp_runs")
    # 16 samples on 2 DP ranks, 4 per micro-batch: 2 micro-batches per rank, so deferring the
    # gradient sync and keeping parameters unsharded between micro-batches change the schedule.
    base = [
        "trainer.device=cpu",
        "model.name=tiny",
        "data.train_batch_size=16",
        "data.synthetic.num_train=128",
        "data.synthetic.num_val=32",
        f"data.synthetic.out_dir={root / 'data'}",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=4",
        "data.micro_batch_size_per_gpu=4",
        "balance.enable=false",
    ]
    fast = [f"model.fsdp_config.{k}={str(v).lower()}" for k, v in FAST_SWITCHES.items()]
    default = _sft_run(base + ["trainer.profile_steps=[2]", f"trainer.default_local_dir={root / 'default'}"])
    switched = _sft_run(base + fast + [f"trainer.default_local_dir={root / 'fast'}"])
    return {"root": root, "default": default, "fast": switched}


@pytest.mark.slow
def test_profile_step_writes_one_trace_per_rank_and_perf_metrics_are_logged(fsdp_runs):
    _, records = fsdp_runs["default"]
    profile_dir = fsdp_runs["root"] / "default" / "profile"
    traces = sorted(
        os.path.relpath(p, profile_dir)
        for p in glob.glob(str(profile_dir / "**" / "*"), recursive=True)
        if os.path.isfile(p)
    )
    assert traces == ["step_2/rank_0.trace.json", "step_2/rank_1.trace.json"]
    assert not os.path.exists(fsdp_runs["root"] / "fast" / "profile"), "negative control: no profile_steps, no trace"
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 4
    for r in steps:
        assert r["perf/tokens_per_s_per_device"] > 0
        assert "train/perf/tokens_per_s_per_device" not in r
        # The engine's own token count is the driver's (non-padding tokens of the mini-batch).
        assert r["train/perf/tokens"] == r["train/global_tokens"]


@pytest.mark.slow
def test_fast_fsdp_switches_give_the_default_loss_curve(fsdp_runs):
    # The default run also profiles step 2 (the test above): tracing does not change the math.
    (ranks_default, default), (ranks_fast, switched) = fsdp_runs["default"], fsdp_runs["fast"]
    # Negative control against a vacuous pass: the switches really reached every worker.
    assert all(r["engine"]["fsdp"] == MEMORY_SAFE for r in ranks_default)
    assert all(r["engine"]["fsdp"] == {**FAST_SWITCHES, **NO_OFFLOAD} for r in ranks_fast)
    curve = {
        name: np.array([r["train/loss"] for r in records if "train/loss" in r])
        for name, records in (("default", default), ("fast", switched))
    }
    grads = {
        name: np.array([r["train/grad_norm"] for r in records if "train/grad_norm" in r])
        for name, records in (("default", default), ("fast", switched))
    }
    assert len(curve["default"]) == 4
    assert not np.allclose(curve["default"][0], curve["default"][-1], rtol=1e-3)  # the model trains
    np.testing.assert_allclose(curve["fast"], curve["default"], rtol=1e-6)
    np.testing.assert_allclose(grads["fast"], grads["default"], rtol=1e-6)


@pytest.mark.slow
def test_grpo_profile_step_traces_each_update_and_logs_perf_metrics(ray_cluster, tmp_path):
    from verl_balance.trainer.grpo.trainer import GRPOTrainer
    from verl_balance.utils.tracking import read_metrics

    # 8 prompts per step in mini-batches of 4, one epoch: U = 2 updates per driver step, so driver
    # step 2 is engine steps 3 and 4.
    cfg = compose_config(
        "grpo",
        [
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=2",
            "trainer.logger=[jsonl]",
            "trainer.plot=false",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.total_training_steps=2",
            "trainer.val_before_train=false",
            "trainer.profile_steps=[2]",
            "data.synthetic.num_train=64",
            "data.synthetic.num_val=4",
            f"data.synthetic.out_dir={tmp_path / 'data'}",
            "data.synthetic.tasks=[copy]",
            "data.synthetic.max_size=6",
            "data.max_prompt_length=32",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.response_length=8",
        ],
    )
    trainer = GRPOTrainer(cfg)
    try:
        trainer.fit()
    finally:
        trainer.close()
    profile_dir = tmp_path / "run" / "profile"
    traces = sorted(
        os.path.relpath(p, profile_dir)
        for p in glob.glob(str(profile_dir / "**" / "*"), recursive=True)
        if os.path.isfile(p)
    )
    assert traces == [f"step_{s}/rank_{r}.trace.json" for s in (3, 4) for r in (0, 1)]
    steps = [
        r for r in read_metrics(os.path.join(cfg.trainer.default_local_dir, "metrics.jsonl")) if "actor/pg_loss" in r
    ]
    assert len(steps) == 2
    for r in steps:
        assert r["perf/tokens_per_s_per_device"] > 0 and r["actor/num_optimizer_steps"] == 2
        assert "actor/perf/tokens_per_s_per_device" not in r
