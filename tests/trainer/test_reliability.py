"""Checkpoint lineage, completeness, atomic state files, retention and fail-fast config checks,
without Ray.

The workers are replaced by a fake group that writes one shard file per save, so each test can
stop a save at a chosen point. References are hand-worked: which step directories must exist,
which checkpoint a resume must pick, which metrics records must remain.
"""

from __future__ import annotations

import errno
import json
import logging
import os
from collections import namedtuple

import pytest

from tests.trainer.conftest import compose_config, run_cli_in_process
from verl_balance.trainer import checkpoint
from verl_balance.trainer.checkpoint import (
    COMPLETE_FILE,
    LATEST_FILE,
    CheckpointDiskFullError,
    CheckpointError,
    CheckpointUnverifiedError,
    latest_checkpoint,
    save_trainer_checkpoint,
    start_run,
)
from verl_balance.trainer.config import ConfigError, check_known_keys, validate_sft
from verl_balance.utils import atomic_io
from verl_balance.utils.tracking import Tracking, TrackingError, read_metrics

CONFIG = {"model": {"name": "tiny"}, "optim": {"lr": 1e-3}, "trainer": {"seed": 1, "save_freq": 2}}


class FakeGroup:
    """Stands in for the worker group: a save writes ``shard.txt`` holding the step."""

    def __init__(self, *, fail_after_shard: bool = False, error: Exception | None = None):
        self.fail_after_shard, self.error, self.loaded = fail_after_shard, error, []

    def save_checkpoint(self, path: str, step: int) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "shard.txt"), "w") as f:
            f.write(str(step))
        if self.error is not None:
            raise self.error
        if self.fail_after_shard:
            raise RuntimeError("worker stopped mid-save")

    def load_checkpoint(self, path: str) -> dict:
        self.loaded.append(path)
        return {}


def _run(root, mode="auto", *, resume_from_path=None, saves=(), group=None, keep=None, config=CONFIG):
    """One run: start (lineage decision), then save at ``saves``; returns (identity, loaded path)."""
    identity, path = start_run(str(root), resume_mode=mode, resume_from_path=resume_from_path, config=config)
    for step in saves:
        save_trainer_checkpoint(
            group or FakeGroup(),
            root=str(root),
            step=step,
            trainer_state={"global_step": step, "loader": {}},
            identity=identity,
            max_to_keep=keep,
        )
    return identity, path


def _steps(root) -> list[int]:
    return sorted(int(n.split("_")[-1]) for n in os.listdir(root) if n.startswith("global_step_"))


# ---------------------------------------------------------------------- 1. identity and lineage
def test_checkpoint_records_run_identity_lineage_and_config_hash(tmp_path):
    identity, _ = _run(tmp_path, saves=[2])
    record = json.loads((tmp_path / "global_step_2" / COMPLETE_FILE).read_text())
    assert record["run_id"] == identity.run_id and record["lineage_id"] == identity.lineage_id
    assert record["start_step"] == 0 and record["step"] == 2
    assert record["config_hash"] == checkpoint.config_hash(CONFIG)
    # The hash follows the keys a resume may not change (seed), not those it applies (lr, save_freq).
    assert checkpoint.config_hash({**CONFIG, "trainer": {"seed": 2, "save_freq": 2}}) != record["config_hash"]
    assert checkpoint.config_hash({**CONFIG, "optim": {"lr": 2e-3}}) == record["config_hash"]
    assert checkpoint.config_hash({**CONFIG, "trainer": {"seed": 1, "save_freq": 5}}) == record["config_hash"]


def test_auto_does_not_resume_the_run_a_disable_run_replaced(tmp_path):
    first, _ = _run(tmp_path, saves=[2, 4])
    fresh, path = _run(tmp_path, "disable")  # killed before its first save
    assert path is None and fresh.lineage_id != first.lineage_id
    assert _steps(tmp_path) == [], "the old run's checkpoints must be moved aside, not left to be resumed"
    moved = list((tmp_path / "superseded").iterdir())
    assert len(moved) == 1 and sorted(os.listdir(moved[0])) >= ["global_step_2", "global_step_4"]
    again, path = _run(tmp_path, "auto")
    assert path is None, "auto must restart the fresh lineage from step 0, not load the old run's step 4"
    assert again.lineage_id == fresh.lineage_id and again.start_step == 0


def test_auto_after_a_rollback_resumes_the_branch_point_not_the_abandoned_branch(tmp_path):
    _run(tmp_path, saves=[2, 4, 6])
    branch, path = _run(tmp_path, "resume_path", resume_from_path=str(tmp_path / "global_step_2"))
    assert path == str(tmp_path / "global_step_2") and branch.start_step == 2
    assert _steps(tmp_path) == [2], "the abandoned branch's steps 4 and 6 are moved aside"
    again, path = _run(tmp_path, "auto")  # the rollback was killed before its first save
    assert path == str(tmp_path / "global_step_2") and again.lineage_id == branch.lineage_id
    _, _ = _run(tmp_path, "auto", saves=[4])
    _, path = _run(tmp_path, "auto")
    assert path == str(tmp_path / "global_step_4")
    assert json.loads((tmp_path / "global_step_4" / COMPLETE_FILE).read_text())["lineage_id"] == branch.lineage_id


def test_auto_in_a_directory_with_another_runs_checkpoints_is_an_error_naming_the_choices(tmp_path):
    legacy = tmp_path / "global_step_3"
    legacy.mkdir()
    (legacy / "trainer_state.json").write_text('{"global_step": 3, "loader": {}}')
    with pytest.raises(CheckpointError, match="resume_mode=disable.*superseded"):
        _run(tmp_path, "auto")
    assert _steps(tmp_path) == [3], "refusing must not touch them"
    with pytest.raises(CheckpointUnverifiedError, match="allow_unverified_checkpoint"):  # no completeness record
        _run(tmp_path, "resume_path", resume_from_path=str(legacy))
    identity, path = start_run(
        str(tmp_path), resume_mode="resume_path", resume_from_path=str(legacy), config=CONFIG, allow_unverified=True
    )
    assert path == str(legacy) and identity.start_step == 3


# ---------------------------------------------------------------------- 2. completeness
def test_resume_picks_the_newest_complete_checkpoint_and_warns_about_an_incomplete_one(tmp_path, caplog):
    identity, _ = _run(tmp_path, saves=[2, 4])
    with pytest.raises(RuntimeError, match="mid-save"):
        save_trainer_checkpoint(
            FakeGroup(fail_after_shard=True),
            root=str(tmp_path),
            step=6,
            trainer_state={"global_step": 6},
            identity=identity,
        )
    (tmp_path / "global_step_8").mkdir()  # e.g. an older version's save, stopped half-way
    (tmp_path / LATEST_FILE).write_text("")  # torn marker: must not matter
    with caplog.at_level(logging.WARNING, logger="verl_balance.trainer.checkpoint"):
        _, path = _run(tmp_path, "auto")
    assert path == str(tmp_path / "global_step_4")
    assert "global_step_8 is incomplete" in caplog.text and ".staging_global_step_6 is incomplete" in caplog.text


def test_a_failed_resave_keeps_the_complete_checkpoint_it_would_replace(tmp_path):
    identity, _ = _run(tmp_path, saves=[4])
    with pytest.raises(RuntimeError):
        save_trainer_checkpoint(
            FakeGroup(fail_after_shard=True),
            root=str(tmp_path),
            step=4,
            trainer_state={"global_step": 4},
            identity=identity,
        )
    assert checkpoint.is_complete(str(tmp_path / "global_step_4"))
    assert latest_checkpoint(str(tmp_path), lineage_id=identity.lineage_id) == str(tmp_path / "global_step_4")
    # A successful re-save replaces it, complete.
    save_trainer_checkpoint(
        FakeGroup(), root=str(tmp_path), step=4, trainer_state={"global_step": 4, "v": 2}, identity=identity
    )
    assert json.loads((tmp_path / "global_step_4" / "trainer_state.json").read_text())["v"] == 2
    assert sorted(os.listdir(tmp_path)) == sorted(["global_step_4", LATEST_FILE, checkpoint.LINEAGE_FILE])


def test_a_save_stopped_between_its_renames_is_finished_on_the_next_scan(tmp_path):
    identity, _ = _run(tmp_path, saves=[2])
    os.rename(tmp_path / "global_step_2", tmp_path / ".staging_global_step_2")  # complete, not yet renamed
    assert latest_checkpoint(str(tmp_path), lineage_id=identity.lineage_id) == str(tmp_path / "global_step_2")


# ---------------------------------------------------------------------- 3. atomic state files, metrics
def test_a_state_file_write_that_fails_leaves_the_old_content_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "trainer_state.json"
    atomic_io.atomic_write_json(str(path), {"global_step": 4})

    def no_fsync(fd):
        raise OSError(errno.EIO, "simulated crash before the rename")

    monkeypatch.setattr(atomic_io.os, "fsync", no_fsync)
    with pytest.raises(OSError):
        atomic_io.atomic_write_json(str(path), {"global_step": 6})
    assert json.loads(path.read_text()) == {"global_step": 4}
    assert os.listdir(tmp_path) == ["trainer_state.json"]


def test_torn_last_metrics_line_is_dropped_with_a_warning_and_not_glued_to_the_next(tmp_path, caplog):
    with Tracking("p", "e", log_dir=str(tmp_path), backends=[]) as tracker:
        tracker.log({"train/loss": 3.0}, step=1)
        tracker.log({"train/loss": 2.0}, step=2)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "train/lo')  # the driver died mid-write
    with caplog.at_level(logging.WARNING, logger="verl_balance.utils.tracking"):
        assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    assert "torn" in caplog.text
    with Tracking("p", "e", log_dir=str(tmp_path), backends=[]) as tracker:
        tracker.log({"train/loss": 1.5}, step=3)
    assert [r["train/loss"] for r in read_metrics(str(tmp_path))] == [3.0, 2.0, 1.5]


def test_a_bad_line_before_the_last_is_still_an_error_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(TrackingError, match="line 2"):
        read_metrics(str(tmp_path))


def _log_steps(root, steps, value):
    with Tracking("p", "e", log_dir=str(root), backends=[]) as tracker:
        for step in steps:
            tracker.log({"train/loss": value + step}, step=step)


def test_each_run_has_its_own_metrics_never_a_mix(tmp_path):
    _run(tmp_path, saves=[2, 4])
    _log_steps(tmp_path, range(1, 6), 10.0)  # the old run logged 1..5
    identity, _ = _run(tmp_path, "disable")
    _log_steps(tmp_path, [1, 2], 20.0)  # the new run logged 1..2
    assert [(r["step"], r["train/loss"]) for r in read_metrics(str(tmp_path))] == [(1, 21.0), (2, 22.0)]
    save_trainer_checkpoint(FakeGroup(), root=str(tmp_path), step=2, trainer_state={}, identity=identity)
    _log_steps(tmp_path, [3], 30.0)  # ... then died after logging step 3
    _, path = _run(tmp_path, "auto")  # resumes step 2: step 3 is cut back
    assert path == str(tmp_path / "global_step_2")
    assert [(r["step"], r["train/loss"]) for r in read_metrics(str(tmp_path))] == [(1, 21.0), (2, 22.0)]


# ---------------------------------------------------------------------- 4. retention and full disks
def test_max_ckpt_to_keep_deletes_only_this_lineages_older_complete_checkpoints(tmp_path):
    _run(tmp_path, saves=[1])
    _run(tmp_path, "resume_path", resume_from_path=str(tmp_path / "global_step_1"), saves=[2, 3, 4, 5], keep=2)
    assert _steps(tmp_path) == [1, 4, 5], "the branch point (another lineage) stays; 2 and 3 are pruned"


def test_a_failed_save_prunes_nothing(tmp_path):
    identity, _ = _run(tmp_path, saves=[1, 2], keep=2)
    with pytest.raises(RuntimeError):
        save_trainer_checkpoint(
            FakeGroup(fail_after_shard=True),
            root=str(tmp_path),
            step=3,
            trainer_state={},
            identity=identity,
            max_to_keep=2,
        )
    assert _steps(tmp_path) == [1, 2]


def test_full_disk_before_a_save_names_the_directory_and_the_free_space(tmp_path, monkeypatch):
    identity, _ = _run(tmp_path, saves=[2])
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.save.shutil, "disk_usage", lambda path: usage(100, 99, 1))
    with pytest.raises(CheckpointDiskFullError, match=rf"{tmp_path}.*1 B free.*max_ckpt_to_keep"):
        save_trainer_checkpoint(FakeGroup(), root=str(tmp_path), step=4, trainer_state={}, identity=identity)
    assert _steps(tmp_path) == [2]


def test_no_space_error_during_a_save_names_the_directory_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    identity, _ = _run(tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(checkpoint.save.shutil, "disk_usage", lambda path: usage(100, 100, 0))
    # What a worker's torch.save reports on ENOSPC (re-raised on the driver with its message).
    error = RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file")
    with pytest.raises(CheckpointDiskFullError, match=rf"default_local_dir='{tmp_path}'.*0 B free"):
        save_trainer_checkpoint(FakeGroup(error=error), root=str(tmp_path), step=2, trainer_state={}, identity=identity)
    assert os.listdir(tmp_path) == [checkpoint.LINEAGE_FILE], "the partial staging directory is removed"
    # Negative control: other failures keep their own type.
    with pytest.raises(ValueError, match="unrelated") as info:
        save_trainer_checkpoint(
            FakeGroup(error=ValueError("unrelated")), root=str(tmp_path), step=2, trainer_state={}, identity=identity
        )
    assert not isinstance(info.value, CheckpointDiskFullError)


# ---------------------------------------------------------------------- 8. driver-side config checks
def test_appended_unknown_key_is_rejected_naming_it():
    cfg = compose_config("sft", ["+data.trian_files=x"])
    with pytest.raises(ConfigError, match=r"data\.trian_files.*train_files"):
        check_known_keys(cfg)
    check_known_keys(compose_config("sft", ["data.train_files=x"]))  # negative control: a real key passes


def test_unusable_default_local_dir_names_the_config_key(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cfg = compose_config("sft", [f"trainer.default_local_dir={blocker / 'run'}"])
    with pytest.raises(ConfigError, match="trainer.default_local_dir.*not a directory"):
        validate_sft(cfg)
    validate_sft(compose_config("sft", [f"trainer.default_local_dir={tmp_path / 'new' / 'run'}"]))


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.max_ckpt_to_keep=0", "trainer.max_ckpt_to_keep"),
        ("trainer.max_restarts=-1", "trainer.max_restarts"),
        ("trainer.max_consecutive_nonfinite_steps=0", "trainer.max_consecutive_nonfinite_steps"),
    ],
)
def test_invalid_reliability_keys_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        validate_sft(compose_config("sft", [override]))


def test_cli_rejects_an_appended_unknown_key_and_an_unusable_output_dir_naming_the_key(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def cli(args):
        return run_cli_in_process("verl_balance.main_sft", args, monkeypatch=monkeypatch, capsys=capsys)

    code, stderr = cli(["+data.trian_files=x", f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert code != 0 and "data.trian_files" in stderr, stderr[-2000:]
    (tmp_path / "a_file").write_text("")
    code, stderr = cli([f"trainer.default_local_dir={tmp_path / 'a_file' / 'run'}"])
    assert code != 0 and "trainer.default_local_dir" in stderr, stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["a_file"], "nothing may be written into the current directory"


@pytest.mark.slow
def test_cli_log_goes_into_the_run_directory_not_the_current_one(cli_sft_run):
    proc, cwd, run_dir = cli_sft_run["proc"], cli_sft_run["cwd"], cli_sft_run["run_dir"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.listdir(cwd) == [], "the CLI must leave nothing (main_sft.log) in the current directory"
    assert "checkpoint: saved step 2" in (run_dir / "main_sft.log").read_text()


# ---------------------------------------------------------------------- 9. rollout seeds
def test_rollout_seeds_are_distinct_per_step_and_sample_where_the_old_formula_collided():
    from verl_balance.workers.actor_rollout import sampling_seed

    # The old per-step seed, seed * 7919 + step, gave (seed 1, step 7919) and (seed 2, step 0) one
    # stream (likewise (2, 7919) and (3, 0)); sampling_seed must keep those pairs, and the whole grid, apart.
    assert sampling_seed(1, 7919) != sampling_seed(2, 0) and sampling_seed(2, 7919) != sampling_seed(3, 0)
    grid = [(seed, step) for seed in (1, 2, 3) for step in range(8000)]
    assert len({sampling_seed(seed, step) for seed, step in grid}) == len(grid)
    seeds = {sampling_seed(sampling_seed(1, step), index) for step in range(20) for index in range(50)}
    assert len(seeds) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert sampling_seed(3, 4) == sampling_seed(3, 4)


def test_auto_resume_with_changed_applied_keys_resumes_and_logs_them(tmp_path, caplog):
    _run(tmp_path, saves=[2])
    changed = {**CONFIG, "optim": {"lr": 5e-3}, "trainer": {"seed": 1, "save_freq": 7}}
    with caplog.at_level(logging.WARNING, logger="verl_balance.trainer.checkpoint"):
        _, path = _run(tmp_path, "auto", config=changed)
    assert path == str(tmp_path / "global_step_2")
    assert "applied from the next step" in caplog.text
    assert "optim.lr: 0.001 -> 0.005" in caplog.text and "trainer.save_freq: 2 -> 7" in caplog.text
