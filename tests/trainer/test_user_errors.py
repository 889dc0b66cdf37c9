"""One user-error path (issues 48 and 49): a user error is one line ``error: ...`` and exit 2
wherever it was raised (the driver, or a worker whose error Ray and the worker group wrap); an
override given twice takes its last value; a value of the wrong type is one line naming the key;
calibration coefficients that would overflow the planner are refused at config time."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.trainer.conftest import REPO_ROOT, compose_config
from verl_balance.algorithms.group_stats import AdvantageInputError
from verl_balance.balance.errors import BalanceConfigError
from verl_balance.balance.workload import CalibratedWorkload
from verl_balance.single_controller import WorkerDiedError
from verl_balance.trainer.checkpoint.layout import CheckpointCorruptError
from verl_balance.trainer.config import ConfigError, validate_sft
from verl_balance.trainer.config.cli import check_overrides, user_error_in, user_errors
from verl_balance.trainer.config.grpo import GRPOConfig
from verl_balance.trainer.config.sft import SFTConfig
from verl_balance.workers.actor_rollout import WarmStartError


def _exit_and_stderr(capsys, fn) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        fn()
    return exit_info.value.code, capsys.readouterr().err


# ---------------------------------------------------------------------- one path, any process
def test_a_worker_group_error_raised_from_a_user_error_is_its_one_line(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def raise_wrapped():
        with user_errors():
            try:
                raise WarmStartError("actor_rollout_ref.model.warm_start_path='/x' does not fit")
            except WarmStartError as err:
                raise WorkerDiedError("worker rank 0 died\nTraceback ...", rank=0, actor_id="a", method="m") from err

    code, err = _exit_and_stderr(capsys, raise_wrapped)
    assert (code, err) == (2, "error: actor_rollout_ref.model.warm_start_path='/x' does not fit\n")


def test_the_outermost_user_error_wins_so_a_re_raise_naming_the_key_is_kept():
    inner = CheckpointCorruptError("model.pt: checksum mismatch")
    try:
        try:
            raise inner
        except CheckpointCorruptError as err:
            raise CheckpointCorruptError(f"actor_rollout_ref.model.warm_start_path='/x': {err}") from err
    except CheckpointCorruptError as outer:
        assert str(user_error_in(outer)).startswith("actor_rollout_ref.model.warm_start_path='/x': ")


def test_a_bug_is_not_a_user_error_even_when_raised_from_one(monkeypatch):
    """Negative control: a KeyError (a bug) keeps its traceback, alone or raised from a user error."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    assert user_error_in(KeyError("x")) is None
    with pytest.raises(KeyError), user_errors():
        raise KeyError("a bug")


def test_hydra_full_error_keeps_the_traceback_of_a_wrapped_user_error(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(WorkerDiedError), user_errors():
        raise WorkerDiedError("died", rank=0, actor_id="a", method="m") from AdvantageInputError("scores not finite")


@pytest.mark.slow  # a real Ray task: the worker's exception crosses the process boundary
def test_a_user_error_raised_in_a_ray_worker_is_one_line_exit_2(ray_cluster, capsys, monkeypatch):
    import ray

    @ray.remote(num_cpus=0)
    def load_weights():
        raise WarmStartError("actor_rollout_ref.model.warm_start_path='/x' does not fit a model of tiny")

    @ray.remote(num_cpus=0)
    def buggy():
        raise KeyError("a bug")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def run():
        with user_errors():
            ray.get(load_weights.remote())

    code, err = _exit_and_stderr(capsys, run)
    assert code == 2
    assert err == "error: actor_rollout_ref.model.warm_start_path='/x' does not fit a model of tiny\n"
    with pytest.raises(ray.exceptions.RayTaskError), user_errors():  # negative control: a bug stays raw
        ray.get(buggy.remote())


# ---------------------------------------------------------------------- Hydra's last-wins
def _recipe_args(script: str) -> list[str]:
    """The overrides a recipe script passes to ``python -m verl_balance.main_*`` (before ``"$@"``)."""
    text = Path(REPO_ROOT, script).read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "python -m verl_balance.main_" in line)
    args = shlex.split(line.split('"$@"')[0])
    return args[args.index("-m") + 2 :]


def test_an_override_appended_to_the_sft_demo_recipe_wins(tmp_path):
    args = _recipe_args("recipes/sft_cpu_demo.sh")
    assert "trainer.total_epochs=1" in args, "the recipe sets 1 itself"
    cfg = validate_sft(
        compose_config("sft", [*args, "trainer.total_epochs=2", f"trainer.default_local_dir={tmp_path}"])
    )
    assert cfg.trainer.total_epochs == 2


def _grpo(args: list[str], tmp_path):
    from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo

    register_grpo_schema()
    return validate_grpo(compose_config("grpo", [*args, f"trainer.default_local_dir={tmp_path}"]))


def test_a_verl_key_given_twice_takes_its_last_value(tmp_path):
    once = _grpo(["data.max_response_length=16", "trainer.logger=console"], tmp_path)
    twice = _grpo(
        ["data.max_response_length=16", "trainer.logger=console", "trainer.logger=[console,jsonl]"]
        + ["data.max_response_length=32"],
        tmp_path,
    )
    assert once.actor_rollout_ref.rollout.response_length == 16 and list(once.trainer.logger) == ["console"]
    assert twice.actor_rollout_ref.rollout.response_length == 32
    assert list(twice.trainer.logger) == ["console", "jsonl"]


@pytest.mark.parametrize(
    "args",
    [
        ["data.max_response_length=48", "actor_rollout_ref.rollout.response_length=32"],
        # each spelling's last value counts: 48 vs 32 still differ after a repeat
        ["data.max_response_length=32", "actor_rollout_ref.rollout.response_length=32", "data.max_response_length=48"],
    ],
)
def test_two_spellings_of_one_key_with_different_last_values_stay_an_error_naming_both(args, tmp_path):
    with pytest.raises(ConfigError, match=r"response_length=32 and data\.max_response_length=48 disagree"):
        _grpo(args, tmp_path)


# ---------------------------------------------------------------------- type errors: one line
@pytest.mark.parametrize(
    "schema, override, expected",
    [
        (
            SFTConfig,
            "data.train_batch_size=sixteen",
            "data.train_batch_size=sixteen is not valid: expected an integer, got the string 'sixteen'",
        ),
        (SFTConfig, "optim.lr=fast", "optim.lr=fast is not valid: expected a number"),
        (SFTConfig, "balance.enable=maybe", "balance.enable=maybe is not valid: expected true or false"),
        (SFTConfig, "trainer.total_epochs=1.5", "trainer.total_epochs=1.5 is not valid: expected an integer, got the"),
        (
            SFTConfig,
            "data.train_batch_size=null",
            "data.train_batch_size=null is not valid: expected an integer, got null",
        ),
        (GRPOConfig, "actor_rollout_ref.rollout.n=four", "actor_rollout_ref.rollout.n=four is not valid: expected"),
    ],
)
def test_a_value_of_the_wrong_type_is_one_line_naming_key_type_and_value(schema, override, expected, capsys):
    code, err = _exit_and_stderr(capsys, lambda: check_overrides([override], schema=schema))
    assert code == 2 and err.startswith(f"error: {expected}") and err.count("\n") == 1, err


def test_values_of_the_right_type_pass_the_type_check():
    """Negative control: Hydra's parse of 16, 1e-3, true, [a,b] and an interpolation all fit."""
    check_overrides(
        ["data.train_batch_size=16", "optim.lr=1e-3", "balance.enable=true", "trainer.logger=[console,jsonl]"]
        + ["trainer.total_epochs=${trainer.save_freq}"],
        schema=SFTConfig,
    )


@pytest.mark.slow  # a subprocess: the interpreter's exit code and stderr
def test_a_type_error_through_the_command_line_is_one_line_exit_2():
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "verl_balance.main_sft", "data.train_batch_size=sixteen"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "HYDRA_FULL_ERROR": "0"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: data.train_batch_size=sixteen is not valid: expected an integer, got the string 'sixteen'"
    ]


# ---------------------------------------------------------------------- calibration overflow
@pytest.mark.parametrize("value", [1e308, 1e7, 1e-308, 1e-31])
def test_calibration_coefficients_outside_the_planners_range_are_refused_naming_the_key(value, tmp_path):
    expected = rf"coefficient pair={re.escape(repr(value))} \(from balance\.calibration_coefficients\) is out of range"
    with pytest.raises(ConfigError, match=expected + r"; valid: 0 or 1e-30 to 1e\+06 seconds"):
        validate_sft(
            compose_config(
                "sft",
                ["balance.workload=calibrated", "+balance.calibration_coefficients={micro_batch: 0, token: 1e-6}"]
                + [f"++balance.calibration_coefficients.pair={value!r}", f"trainer.default_local_dir={tmp_path}"],
            )
        )


def test_calibration_coefficients_at_the_range_ends_plan_without_overflow():
    """The range's ends against the planner itself: 256 sequences up to 200k tokens, every mix of
    0 / smallest / largest coefficient plans with finite costs (numpy warnings are errors)."""
    import itertools
    import warnings

    import numpy as np

    from verl_balance.balance.plan import plan_balance

    lengths = np.random.default_rng(0).integers(1, 200_000, size=256)
    for mb, seq, tok, pair in itertools.product([0, 1e-30, 1e6], [0, 1e-30, 1e6], [0, 1e-30, 1e6], [1e-30, 1e6]):
        workload = CalibratedWorkload(micro_batch=mb, sequence=seq, token=tok, pair=pair)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            plan = plan_balance(seq_lens=lengths, dp_size=4, micro_batch_size=4, workload=workload)
        assert np.isfinite(plan.cell_costs).all()
        assert sorted(np.concatenate([i for mbs in plan.micro_batches for i in mbs]).tolist()) == list(range(256))
    with pytest.raises(BalanceConfigError, match="out of range"):  # negative control: just past the end
        CalibratedWorkload(micro_batch=0, sequence=0, token=1e6 * 1.01, pair=0)


# ---------------------------------------------------------------------- separate_async from one line
def test_separate_async_from_one_line_derives_the_pool_and_the_sync_step_and_names_them(caplog):
    import logging

    from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo

    register_grpo_schema()
    one_line = ["trainer.device=cpu", "trainer.v1.trainer_mode=separate_async"]
    sizes = ["data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.n_gpus_per_node=2"]
    with caplog.at_level(logging.INFO, logger="verl_balance.trainer.config.async_mode"):
        config = validate_grpo(compose_config("grpo", one_line + sizes))
    assert config.trainer.v1.separate_async.parameter_sync_step == 3  # 12 prompts / mini-batches of 4
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.nnodes, rollout.n_gpus_per_node, rollout.rollout_workers) == (1, 2, 2)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("parameter_sync_step not set, using 3" in line for line in lines) == 1, lines
    assert sum("rollout.nnodes not set, using 1 node x n_gpus_per_node=2" in line for line in lines) == 1, lines
    # verl's 0 for the pool's workers per node is "unset" too; explicit values are kept and not named
    caplog.clear()
    explicit = ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=0"]
    config = validate_grpo(
        compose_config("grpo", one_line + sizes + explicit + ["trainer.v1.separate_async.parameter_sync_step=3"])
    )
    assert (config.actor_rollout_ref.rollout.rollout_workers, config.trainer.v1.separate_async.parameter_sync_step) == (
        2,
        3,
    )
    assert not [r for r in caplog.records if "not set, using" in r.getMessage()]


def test_an_explicit_parameter_sync_step_against_verls_rule_stays_an_error():
    from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo

    register_grpo_schema()
    overrides = ["trainer.device=cpu", "trainer.v1.trainer_mode=separate_async", "data.train_batch_size=12"]
    overrides += ["actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.v1.separate_async.parameter_sync_step=4"]
    with pytest.raises(ConfigError, match=r"parameter_sync_step=4 x .*must equal data\.train_batch_size=12"):
        validate_grpo(compose_config("grpo", overrides))
