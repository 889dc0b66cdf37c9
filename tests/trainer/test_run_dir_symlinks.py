"""Nothing in the run directory is written through a symbolic link planted there: the lock, the log
file, metrics.jsonl, the staging directory, ``superseded/`` and the latest-step file. Each planted
link is refused with an error naming it (or, for files replaced atomically, replaced itself), and
the file it points to outside the run directory is unchanged. No Ray.

Negative control: the plain ``open`` the code used before follows the same link and overwrites
the target."""

from __future__ import annotations

import logging
import os

import pytest

from verl_balance.trainer.checkpoint import LATEST_FILE, SUPERSEDED_DIR, save_trainer_checkpoint, start_run
from verl_balance.trainer.checkpoint.run_lock import LOCK_FILE, acquire_run_lock
from verl_balance.utils.atomic_io import NoFollowFileHandler, UnsafePathError, atomic_write_text
from verl_balance.utils.tracking import METRICS_FILE, Tracking

CONFIG = {"trainer": {"seed": 1}}
PRECIOUS = "the user's file outside the run directory\n"


class FakeGroup:
    def save_checkpoint(self, path: str, step: int) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "shard_0.bin"), "wb") as f:
            f.write(b"shard")


@pytest.fixture
def precious(tmp_path):
    """A file outside the run directory that a planted link points to."""
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir()
    path.write_text(PRECIOUS)
    return path


def _plant(run, name: str, target) -> str:
    run.mkdir(exist_ok=True)
    link = run / name
    os.symlink(target, link)
    return str(link)


def test_a_link_planted_as_the_run_lock_is_refused_and_its_target_unchanged(tmp_path, precious):
    link = _plant(tmp_path / "run", LOCK_FILE, precious)
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        acquire_run_lock(str(tmp_path / "run"))
    assert precious.read_text() == PRECIOUS


def test_a_link_planted_as_the_log_file_is_refused_and_its_target_unchanged(tmp_path, precious):
    link = _plant(tmp_path / "run", "main_sft.log", precious)
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        NoFollowFileHandler(link)
    assert precious.read_text() == PRECIOUS
    handler = logging.FileHandler(link)  # negative control: the handler used before appends to the target
    handler.emit(logging.makeLogRecord({"msg": "run log line"}))
    handler.close()
    assert precious.read_text() != PRECIOUS


def test_a_link_planted_as_metrics_jsonl_is_refused_and_its_target_unchanged(tmp_path, precious):
    link = _plant(tmp_path / "run", METRICS_FILE, precious)
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        Tracking("p", "e", log_dir=str(tmp_path / "run"), backends=["jsonl"])
    assert precious.read_text() == PRECIOUS


def test_a_link_planted_as_superseded_receives_no_checkpoint(tmp_path):
    run = tmp_path / "run"
    identity, _ = start_run(str(run), resume_mode="auto", resume_from_path=None, config=CONFIG)
    save_trainer_checkpoint(FakeGroup(), root=str(run), step=2, trainer_state={"global_step": 2}, identity=identity)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = _plant(run, SUPERSEDED_DIR, elsewhere)
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        start_run(str(run), resume_mode="disable", resume_from_path=None, config=CONFIG)
    assert os.listdir(elsewhere) == [] and os.path.isdir(run / "global_step_2")


def test_a_link_planted_as_the_staging_directory_is_refused(tmp_path):
    run = tmp_path / "run"
    identity, _ = start_run(str(run), resume_mode="auto", resume_from_path=None, config=CONFIG)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = _plant(run, ".staging_global_step_2", elsewhere)
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        save_trainer_checkpoint(FakeGroup(), root=str(run), step=2, trainer_state={}, identity=identity)
    assert os.listdir(elsewhere) == []


def test_a_link_planted_as_the_latest_step_file_is_refused_and_its_target_unchanged(tmp_path, precious):
    run = tmp_path / "run"
    identity, _ = start_run(str(run), resume_mode="auto", resume_from_path=None, config=CONFIG)
    link = _plant(run, LATEST_FILE, precious)
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        save_trainer_checkpoint(FakeGroup(), root=str(run), step=2, trainer_state={}, identity=identity)
    assert precious.read_text() == PRECIOUS


def test_an_atomic_write_replaces_a_planted_link_never_its_target(tmp_path, precious):
    link = _plant(tmp_path / "run", "run_lineage.json", precious)
    atomic_write_text(link, "{}")
    assert not os.path.islink(link) and open(link).read() == "{}"
    assert precious.read_text() == PRECIOUS
