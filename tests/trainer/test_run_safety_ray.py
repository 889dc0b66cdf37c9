"""Run-directory lock, resume with a changed learning rate and the non-finite guard on an embedded
Ray cluster (2 CPU workers, tiny model, a few steps).

References: the learning rate a resumed run must log is the cosine formula with the new rate; the
loss a resumed run logs at its first step is that of the unchanged resume (same restored weights).
"""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest

from tests.trainer.conftest import compose_config, train_sft
from verl_balance.testing.faults import InfWeightsTrainEngine, NaNLossTrainEngine
from verl_balance.trainer.checkpoint import COMPLETE_FILE
from verl_balance.trainer.checkpoint.run_lock import RunDirectoryBusyError
from verl_balance.trainer.driver import NonFiniteTrainingError
from verl_balance.trainer.sft_trainer import SFTTrainer
from verl_balance.utils.tracking import read_metrics
from verl_balance.workers.actor import ActorWorker

pytestmark = pytest.mark.slow


def _base(tiny_sft_overrides, tmp_path, name: str, *extra: str) -> list[str]:
    keep = [o for o in tiny_sft_overrides if not o.startswith(("trainer.default_local_dir", "trainer.resume_mode"))]
    return keep + ["trainer.n_gpus_per_node=2", f"trainer.default_local_dir={tmp_path / name}", *extra]


def _step_dirs(root) -> list[int]:
    return sorted(int(n.rsplit("_", 1)[1]) for n in os.listdir(root) if n.startswith("global_step_"))


def test_a_second_run_in_a_live_runs_directory_is_refused_and_the_first_keeps_its_checkpoints(
    ray_cluster, tiny_sft_overrides, tmp_path
):
    overrides = _base(
        tiny_sft_overrides, tmp_path, "run", "trainer.resume_mode=auto", "trainer.total_training_steps=2"
    ) + ["trainer.save_freq=1"]
    first = SFTTrainer(compose_config("sft", overrides))
    try:
        # The same command with another lr, started while the first run lives: refused before it
        # reads or writes anything in the directory.
        with pytest.raises(RunDirectoryBusyError) as info:
            SFTTrainer(compose_config("sft", overrides + ["optim.lr=1e-2"]))
        assert f"trainer.default_local_dir='{tmp_path / 'run'}'" in str(info.value)
        assert f"pid {os.getpid()} on host" in str(info.value)
        summary = first.fit()
    finally:
        first.close()
    assert summary["steps"] == 2 and _step_dirs(tmp_path / "run") == [1, 2]
    for step in (1, 2):
        record = json.loads((tmp_path / "run" / f"global_step_{step}" / COMPLETE_FILE).read_text())
        assert record["run_id"] == first.run_identity.run_id, "every checkpoint is the first run's own"
    assert [r["step"] for r in read_metrics(str(tmp_path / "run"))] == [1, 2]


def _cosine(lr: float, step: int, total: int) -> float:
    """The lr logged at 1-based step ``step`` of a cosine schedule over ``total`` steps (no warmup)."""
    return lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / total))


def test_a_learning_rate_changed_on_resume_takes_effect_from_the_next_step(ray_cluster, tiny_sft_overrides, tmp_path):
    schedule = [
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "optim.lr_scheduler=cosine",
        "optim.warmup_steps_ratio=0",
        "optim.min_lr_ratio=0",
    ]
    train_sft(_base(tiny_sft_overrides, tmp_path, "same", *schedule, "optim.lr=1e-3"), stop_after=2)
    shutil.copytree(tmp_path / "same", tmp_path / "changed")
    same = train_sft(
        _base(tiny_sft_overrides, tmp_path, "same", *schedule, "optim.lr=1e-3", "trainer.resume_mode=auto")
    )
    changed = train_sft(
        _base(tiny_sft_overrides, tmp_path, "changed", *schedule, "optim.lr=1e-4", "trainer.resume_mode=auto")
    )
    assert [r["step"] for r in same] == [r["step"] for r in changed] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["train/lr"] for r in same], [_cosine(1e-3, s, 4) for s in (1, 2, 3, 4)], rtol=1e-9)
    expected = [_cosine(1e-3, 1, 4), _cosine(1e-3, 2, 4), _cosine(1e-4, 3, 4), _cosine(1e-4, 4, 4)]
    np.testing.assert_allclose([r["train/lr"] for r in changed], expected, rtol=1e-9)
    # Step 3's loss is taken before its update (same restored weights); step 4 follows the new lr.
    assert changed[2]["train/loss"] == pytest.approx(same[2]["train/loss"], rel=1e-6)
    assert changed[3]["train/loss"] != pytest.approx(same[3]["train/loss"], rel=1e-6)


class NaNFromStep3Worker(ActorWorker):
    """An actor rank whose training loss is NaN from step 3 on (testing.faults)."""

    engine_cls = NaNLossTrainEngine


class NaNLossSFTTrainer(SFTTrainer):
    worker_cls = NaNFromStep3Worker


def test_a_nan_loss_stops_the_run_after_n_steps_naming_the_step_and_the_last_finite_checkpoint_survives(
    ray_cluster, tiny_sft_overrides, tmp_path
):
    assert NaNLossTrainEngine.nan_from_step == 3
    overrides = _base(
        tiny_sft_overrides,
        tmp_path,
        "run",
        "trainer.total_training_steps=8",
        "trainer.save_freq=1",
        "trainer.max_ckpt_to_keep=2",
        "trainer.max_consecutive_nonfinite_steps=2",
    )
    trainer = NaNLossSFTTrainer(compose_config("sft", overrides))
    try:
        with pytest.raises(NonFiniteTrainingError, match=r"stopped at step 4: 2 consecutive non-finite") as info:
            trainer.fit()
    finally:
        trainer.close()
    assert f"known to be finite (a finite step ran from it) is {tmp_path / 'run' / 'global_step_1'}" in str(info.value)
    assert _step_dirs(tmp_path / "run") == [1, 2], "no checkpoint of a NaN step; retention kept the finite ones"
    records = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["train/loss"]) for r in records[:2])
    assert all(math.isnan(r["train/loss"]) and r["train/step_skipped"] == 1.0 for r in records[2:])
    assert [r["train/nonfinite_steps"] for r in records] == [0.0, 0.0, 1.0, 2.0]


class InfAfterStep3Worker(ActorWorker):
    """An actor rank whose update of step 3 leaves infinite weights (testing.faults)."""

    engine_cls = InfWeightsTrainEngine


class InfWeightsSFTTrainer(SFTTrainer):
    worker_cls = InfAfterStep3Worker


def test_retention_keeps_the_last_finite_checkpoint_when_a_finite_step_saves_broken_weights(
    ray_cluster, tiny_sft_overrides, tmp_path
):
    # Step 3 logs a finite loss but leaves inf weights, saved as global_step_3; step 4 is NaN. With
    # max_ckpt_to_keep=1 plain retention would keep only global_step_3.
    assert InfWeightsTrainEngine.inf_after_step == 3
    overrides = _base(
        tiny_sft_overrides,
        tmp_path,
        "run",
        "trainer.total_training_steps=8",
        "trainer.save_freq=1",
        "trainer.max_ckpt_to_keep=1",
        "trainer.max_consecutive_nonfinite_steps=2",
    )
    trainer = InfWeightsSFTTrainer(compose_config("sft", overrides))
    try:
        with pytest.raises(NonFiniteTrainingError, match=r"stopped at step 5: 2 consecutive non-finite") as info:
            trainer.fit()
    finally:
        trainer.close()
    assert f"is {tmp_path / 'run' / 'global_step_2'};" in str(info.value)
    assert _step_dirs(tmp_path / "run") == [2, 3], "global_step_2 (the last finite one) survives retention"
    losses = [r["train/loss"] for r in read_metrics(str(tmp_path / "run"))]
    assert [math.isfinite(x) for x in losses] == [True, True, True, False, False]
