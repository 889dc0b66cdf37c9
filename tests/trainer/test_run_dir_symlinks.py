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


# ---------------------------------------------------------------------- the rest of the run's paths (issue 50)
def test_a_link_planted_as_curves_png_is_replaced_never_its_target(tmp_path, precious):
    from verl_balance.utils.plotting import plot_runs

    run = tmp_path / "run"
    run.mkdir()
    (run / METRICS_FILE).write_text('{"step": 1, "train/loss": 1.0}\n{"step": 2, "train/loss": 0.5}\n')
    link = _plant(run, "curves.png", precious)
    plot_runs([str(run)], out=link)
    assert not os.path.islink(link) and open(link, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert precious.read_text() == PRECIOUS
    os.remove(link)
    os.symlink(precious, link)
    import matplotlib.pyplot as plt  # negative control: matplotlib's savefig writes through the link

    fig = plt.figure()
    fig.savefig(link)
    plt.close(fig)
    assert precious.read_bytes()[:4] == b"\x89PNG"


def test_a_link_planted_as_the_synthetic_data_directory_is_refused_and_receives_nothing(tmp_path):
    from verl_balance.data.synthetic import write_dataset
    from verl_balance.trainer.config.sections import resolve_data_files
    from verl_balance.trainer.config.sft import SFTDataSection

    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = _plant(run, "data", elsewhere)
    data = SFTDataSection()
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        resolve_data_files(data, kind="sft", default_local_dir=str(run))
    assert os.listdir(elsewhere) == []
    write_dataset(out_dir=link, num_train=2, num_val=1, seed=0)  # negative control: a plain write follows it
    assert "sft_train.parquet" in os.listdir(elsewhere)


def test_a_link_planted_as_the_tensorboard_directory_is_refused_and_receives_nothing(tmp_path):
    pytest.importorskip("tensorboard")
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    elsewhere.mkdir()
    link = _plant(run, "tensorboard", elsewhere)
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        Tracking("p", "e", log_dir=str(run), backends=["jsonl", "tensorboard"])
    assert os.listdir(elsewhere) == []


def test_a_metrics_jsonl_link_on_resume_is_neither_read_nor_replaced(tmp_path, precious):
    from verl_balance.utils.tracking import drop_torn_last_line, rewrite_metrics_up_to

    other = '{"step": 1, "train/loss": 123.0}\n'
    precious.write_text(other)
    run = tmp_path / "run"
    identity, _ = start_run(str(run), resume_mode="auto", resume_from_path=None, config=CONFIG)
    save_trainer_checkpoint(FakeGroup(), root=str(run), step=2, trainer_state={"global_step": 2}, identity=identity)
    link = _plant(run, METRICS_FILE, precious)
    with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
        start_run(str(run), resume_mode="auto", resume_from_path=None, config=CONFIG)
    for call in (lambda: rewrite_metrics_up_to(link, 2), lambda: drop_torn_last_line(link)):
        with pytest.raises(UnsafePathError, match=rf"{link} is a symbolic link"):
            call()
    assert os.path.islink(link) and precious.read_text() == other
    with open(link, encoding="utf-8") as f:  # negative control: the plain read copies the other file's line
        assert f.read() == other


def test_a_run_lineage_link_is_refused_naming_the_link(tmp_path, precious):
    from verl_balance.trainer.checkpoint import LINEAGE_FILE, LineageFileError

    precious.write_text('{"lineage_id": "x"}')
    run = tmp_path / "run"
    link = _plant(run, LINEAGE_FILE, precious)
    with pytest.raises(LineageFileError, match=rf"{link} is a symbolic link"):
        start_run(str(run), resume_mode="auto", resume_from_path=None, config=CONFIG)
    assert precious.read_text() == '{"lineage_id": "x"}'


def _hard_link(run, name: str, target) -> str:
    run.mkdir(exist_ok=True)
    os.link(target, run / name)
    return str(run / name)


@pytest.mark.parametrize("name", [LOCK_FILE, "main_sft.log", METRICS_FILE])
def test_a_hard_linked_run_file_is_refused_and_its_target_unchanged(tmp_path, precious, name):
    link = _hard_link(tmp_path / "run", name, precious)
    opener = {
        LOCK_FILE: lambda: acquire_run_lock(str(tmp_path / "run")),
        "main_sft.log": lambda: NoFollowFileHandler(link),
        METRICS_FILE: lambda: Tracking("p", "e", log_dir=str(tmp_path / "run"), backends=["jsonl"]),
    }[name]
    with pytest.raises(UnsafePathError, match=rf"{link} has 2 hard links"):
        opener()
    assert precious.read_text() == PRECIOUS
    with open(link, "a", encoding="utf-8") as f:  # negative control: a plain open writes the other name's file
        f.write("appended\n")
    assert precious.read_text() == PRECIOUS + "appended\n"


def test_open_nofollow_w_checks_hard_links_before_truncating(tmp_path, precious):
    from verl_balance.utils.atomic_io import open_nofollow

    link = _hard_link(tmp_path / "run", "state.txt", precious)
    with pytest.raises(UnsafePathError, match="2 hard links"):
        open_nofollow(link, "w")
    assert precious.read_text() == PRECIOUS
    with open_nofollow(str(tmp_path / "run" / "fresh.txt"), "w") as f:  # a single-link file: truncated, written
        f.write("a")
    with open_nofollow(str(tmp_path / "run" / "fresh.txt"), "w") as f:
        f.write("b")
    assert (tmp_path / "run" / "fresh.txt").read_text() == "b"
