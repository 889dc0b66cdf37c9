"""balance.workload=calibrated: config keys, errors naming them, the run's copy of the calibration."""

from __future__ import annotations

import json

import pytest

from tests.trainer.conftest import compose_config
from verl_balance.balance.workload import CalibratedWorkload
from verl_balance.trainer.config import CALIBRATION_RUN_FILE, ConfigError, record_workload, validate_sft
from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo

COEFFICIENTS = {"micro_batch": 5.5e-3, "sequence": 1e-4, "token": 2e-5, "pair": 3e-9}


@pytest.fixture
def calibration_file(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"coefficients": COEFFICIENTS, "fingerprint": {"model": "small"}}))
    return str(path)


def test_calibrated_workload_from_file_with_overrides(calibration_file, tmp_path):
    cfg = compose_config(
        "sft",
        [
            "balance.workload=calibrated",
            f"balance.calibration_path={calibration_file}",
            "+balance.calibration_coefficients.micro_batch=0.01",
            f"trainer.default_local_dir={tmp_path}/run",
        ],
    )
    workload = validate_sft(cfg).balance.workload_for(None)
    assert isinstance(workload, CalibratedWorkload)
    assert workload == CalibratedWorkload(**{**COEFFICIENTS, "micro_batch": 0.01})
    assert workload.fingerprint["overridden"] == ["micro_batch"]


def test_calibrated_workload_from_coefficients_alone(tmp_path):
    register_grpo_schema()
    cfg = compose_config(
        "grpo",
        ["balance.workload=calibrated"]
        + [f"+balance.calibration_coefficients.{k}={v}" for k, v in COEFFICIENTS.items()],
    )
    assert validate_grpo(cfg).balance.workload_for(None) == CalibratedWorkload(**COEFFICIENTS)


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        (["balance.workload=calibrated"], r"balance\.workload=calibrated needs balance\.calibration_path"),
        (["balance.calibration_path=/nowhere.json"], r"balance\.workload='flops'"),
        (["balance.workload=calibrated", "balance.calibration_path=/nowhere.json"], r"/nowhere\.json.*does not exist"),
        (
            ["balance.workload=calibrated", "+balance.calibration_coefficients.micro_batch=0.01"],
            r"missing \['token', 'pair'\]",
        ),
        (
            ["balance.workload=calibrated"]
            + [f"+balance.calibration_coefficients.{k}={-1 if k == 'token' else v}" for k, v in COEFFICIENTS.items()],
            r"balance\.workload=calibrated: .*token=-1",
        ),
    ],
)
def test_bad_calibration_config_is_rejected_naming_the_key(overrides, pattern, tmp_path):
    cfg = compose_config("sft", overrides + [f"trainer.default_local_dir={tmp_path}/run"])
    with pytest.raises(ConfigError, match=pattern):
        validate_sft(cfg)


def test_the_run_keeps_the_calibration_it_planned_with(tmp_path):
    workload = CalibratedWorkload(**COEFFICIENTS, fingerprint={"model": "small"}, source="cal.json")
    path = record_workload(workload, str(tmp_path))
    assert path == str(tmp_path / CALIBRATION_RUN_FILE)
    saved = json.loads((tmp_path / CALIBRATION_RUN_FILE).read_text())
    assert saved["source"] == "cal.json" and CalibratedWorkload.from_dict(saved) == workload
    # The FLOPs / token models write nothing.
    assert record_workload(object(), str(tmp_path / "other")) is None
    assert not (tmp_path / "other").exists()
