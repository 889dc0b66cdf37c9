"""Fuzzed configuration (issue 49): every numeric key of the SFT and GRPO schemas (enumerated from
the typed schema, not a hand list) and every coefficient of a calibration file, set to each of
0, -1, 1, 1e-308, 1e308, nan, inf and a string, either passes start-up validation or fails in
one line naming the key (exit 2 from the command line); never a traceback, a hang or a
non-finite value that the run would train with.

Start-up validation here is what the entry points run before Ray, in process: the command line's
type check (``check_overrides``), the value merged into the recipe's config as Hydra merges an
override, and ``validate_sft`` / ``validate_grpo`` (the typed config and every cross-key check).
A hypothesis property combines several fuzzed keys and runs the trainers' pre-Ray checks too
(data, model, layout; Ray's start is replaced by a sentinel). A few subprocess cases prove the
process-level contract: exit code 2 and one line on stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import DictConfig, OmegaConf
from omegaconf.nodes import FloatNode, IntegerNode

from tests.trainer.conftest import compose_config
from verl_balance.trainer import cluster
from verl_balance.trainer.config import validate_sft
from verl_balance.trainer.config.cli import check_overrides, user_error_in
from verl_balance.trainer.config.grpo import GRPOConfig, register_grpo_schema, validate_grpo
from verl_balance.trainer.config.sft import SFTConfig

VALUES = ("0", "-1", "1", "1e-308", "1e308", "nan", "inf", "not_a_number")
RECIPES = {"sft": (SFTConfig, validate_sft), "grpo": (GRPOConfig, validate_grpo)}


def numeric_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Every int and float key (optional ones too) of a structured config, through its typed sections."""
    keys = []
    for name in node.keys():
        child, key = node._get_node(name), f"{prefix}{name}"
        if isinstance(child, DictConfig):
            if not child._is_none() and dataclasses.is_dataclass(OmegaConf.get_type(child)):
                keys += numeric_keys(child, key + ".")
        elif isinstance(child, (IntegerNode, FloatNode)):
            keys.append(key)
    return keys


def _names_the_key(message: str, key: str) -> bool:
    """The message names ``key``, or a section of it (``critic.optim`` for ``critic.optim.lr``)."""
    parts = key.split(".")
    return any(".".join(parts[:end]) in message for end in range(len(parts), 1, -1)) or (
        len(parts) == 1 and key in message
    )


def startup_outcome(recipe: str, base: DictConfig, overrides: list[str]) -> str | None:
    """None when ``overrides`` pass start-up validation, else the one-line user error; fails the
    test on anything else (a raw exception, a multi-line message, an exit code other than 2)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    schema, validate = RECIPES[recipe]
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            check_overrides(overrides, schema=schema)
    except SystemExit as exit_info:
        assert exit_info.code == 2, (overrides, exit_info.code)
        line = stderr.getvalue()
        assert line.startswith("error: ") and line.count("\n") == 1, (overrides, line)
        return line[len("error: ") : -1]
    cfg = base.copy()
    for override in OverridesParser.create().parse_overrides(overrides):
        OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True)
    try:
        validate(cfg)
    except Exception as err:  # noqa: BLE001 - classified right here: a user error or a failed test
        found = user_error_in(err)
        assert found is not None, f"{overrides}: not a user error: {type(err).__name__}: {err}"
        message = str(found)
        assert "\n" not in message, (overrides, message)
        return message
    return None


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, DictConfig]:
    register_grpo_schema()
    root = tmp_path_factory.mktemp("fuzz")
    return {name: compose_config(name, [f"trainer.default_local_dir={root / name}"]) for name in RECIPES}


@pytest.mark.slow  # no second process, but 1,136 in-process validations (about 1 min on 2 busy cores)
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_numeric_key_at_every_extreme_passes_or_names_the_key_in_one_line(recipe, bases):
    keys = numeric_keys(OmegaConf.structured(RECIPES[recipe][0]))
    assert len(keys) > (30 if recipe == "sft" else 90), "the schema walk found the keys"
    outcomes = {"passed": 0, "refused": 0}
    for key in keys:
        for value in VALUES:
            message = startup_outcome(recipe, bases[recipe], [f"{key}={value}"])
            if message is None:
                assert value not in ("nan", "inf", "1e308", "not_a_number"), f"{key}={value} was accepted"
                outcomes["passed"] += 1
            else:
                assert _names_the_key(message, key), f"{key}={value}: the message does not name the key: {message}"
                outcomes["refused"] += 1
    assert outcomes["passed"] + outcomes["refused"] == len(keys) * len(VALUES)
    assert outcomes["passed"] and outcomes["refused"]  # both kinds of outcome occur: the check can fail
    print(f"{recipe}: {len(keys)} numeric keys x {len(VALUES)} values = {len(keys) * len(VALUES)} cases, {outcomes}")


def test_the_key_check_fails_on_a_message_naming_another_key():
    """Negative control of the classification itself."""
    assert _names_the_key("critic.optim set but ...", "critic.optim.lr")
    assert not _names_the_key("data.train_batch_size=0 must be positive", "trainer.total_epochs")


# ---------------------------------------------------------------------- calibration files
@pytest.mark.parametrize("coefficient", ["micro_batch", "sequence", "token", "pair"])
def test_every_calibration_coefficient_at_every_extreme_passes_or_names_it(coefficient, tmp_path):
    base = {"micro_batch": 1e-3, "sequence": 1e-5, "token": 1e-6, "pair": 1e-9}
    refused = 0
    for value in VALUES:
        number = value if value == "not_a_number" else float(value)
        path = tmp_path / f"calibration_{value}.json"
        path.write_text(json.dumps({"coefficients": {**base, coefficient: number}, "fingerprint": {}}))
        overrides = ["balance.workload=calibrated", f"balance.calibration_path={path}"]
        cfg = compose_config("sft", overrides + [f"trainer.default_local_dir={tmp_path / 'run'}"])
        try:
            validate_sft(cfg)
        except Exception as err:  # noqa: BLE001 - a user error naming the coefficient, or a failed test
            found = user_error_in(err)
            assert found is not None and "\n" not in str(found), f"{coefficient}={value}: {err!r}"
            assert f"coefficient {coefficient}=" in str(found) and str(path) in str(found), str(found)
            refused += 1
            continue
        assert value in ("0", "1"), f"{coefficient}={value} was accepted"
    assert refused == 6  # -1, 1e-308, 1e308, nan, inf, the string; 0 and 1 (seconds) are valid


# ---------------------------------------------------------------------- several keys at once, to Ray's door
def _all_cases() -> list[tuple[str, str, str]]:
    return [
        (recipe, key, value)
        for recipe, (schema, _) in sorted(RECIPES.items())
        for key in numeric_keys(OmegaConf.structured(schema))
        for value in VALUES
    ]


RAY_DOOR = "start-up validation passed: Ray would start here"


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(recipe=st.sampled_from(sorted(RECIPES)), picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=3))
def test_fuzzed_keys_together_pass_the_pre_ray_checks_or_name_a_key(recipe, picks, bases, tmp_path, monkeypatch):
    """Up to three fuzzed keys at once: a one-line error naming one of them, or the trainer gets to
    Ray's start (the data, model and layout checks before it passed too)."""
    cases = [c for c in _all_cases() if c[0] == recipe]
    chosen = {cases[p % len(cases)][1]: cases[p % len(cases)][2] for p in picks}
    fuzzed = [f"{key}={value}" for key, value in chosen.items()]
    small = [
        "trainer.device=cpu",
        "data.synthetic.num_train=32",
        "data.synthetic.num_val=8",
        f"data.synthetic.out_dir={tmp_path / 'data'}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    small += ["model.name=tiny"] if recipe == "sft" else ["actor_rollout_ref.model.name=tiny"]
    small = [s for s in small if s.split("=")[0] not in chosen]
    message = startup_outcome(recipe, bases[recipe], small + fuzzed)
    if message is not None:
        assert any(_names_the_key(message, o.split("=")[0]) for o in small + fuzzed), (fuzzed, message)
        return

    def started(**kwargs):
        raise AssertionError(RAY_DOOR)

    monkeypatch.setattr(cluster, "start_ray", started)
    from verl_balance.trainer.grpo.trainer import GRPOTrainer
    from verl_balance.trainer.sft_trainer import SFTTrainer

    trainer_cls = SFTTrainer if recipe == "sft" else GRPOTrainer
    try:
        trainer_cls(compose_config(recipe, small + fuzzed)).close()
    except AssertionError as err:
        assert RAY_DOOR in str(err), err
    except Exception as err:  # noqa: BLE001 - a pre-Ray user error, or a failed test
        found = user_error_in(err)
        assert found is not None and "\n" not in str(found), f"{fuzzed}: {type(err).__name__}: {err}"
        assert any(_names_the_key(str(found), o.split("=")[0]) for o in small + fuzzed), (fuzzed, str(found))


# ---------------------------------------------------------------------- the process: exit 2, one line
@pytest.mark.slow  # a subprocess per case: the interpreter's exit code and stderr
@pytest.mark.parametrize(
    "module, override, expected",
    [
        ("verl_balance.main_sft", "optim.lr=nan", "optim.lr=nan must be > 0"),
        ("verl_balance.main_sft", "optim.lr=1e308", "optim.lr=1e+308 is out of range"),
        ("verl_balance.main_grpo", "actor_rollout_ref.rollout.n=not_a_number", "actor_rollout_ref.rollout.n="),
    ],
)
def test_a_fuzzed_value_on_the_command_line_is_one_line_and_exit_2(module, override, expected, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run(
        [sys.executable, "-m", module, override, f"trainer.default_local_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {expected}"), proc.stderr[-2000:]
