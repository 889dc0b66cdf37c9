"""A full disk anywhere (checkpoint save, run log, metrics) is recognised, by errno or by torch's
own short-write message, and named with the directory and its free space; a failed save leaves no
staging directory and the previous checkpoint intact; the console survives a log that cannot be
written (issue 50). No Ray.

The real case runs on a 20 MiB tmpfs when this process may mount one (root); ``/dev/full`` (every
write fails with ENOSPC) stands in for a full disk elsewhere.
"""

from __future__ import annotations

import errno
import io
import os
import re
import subprocess
import sys

import pytest
import torch

from verl_balance.trainer.checkpoint import (
    CheckpointDiskFullError,
    save_trainer_checkpoint,
    start_run,
    verify_checkpoint,
)
from verl_balance.utils.disk import is_disk_full
from verl_balance.utils.run_log import RunLog
from verl_balance.utils.tracking import Tracking, TrackingError

CONFIG = {"trainer": {"seed": 1}}
TORCH_SHORT_WRITE = "[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


class TensorGroup:
    """Writes one shard of ``mib`` MiB with torch.save, as the workers' DCP/engine state do."""

    def __init__(self, mib: int) -> None:
        self.mib = mib

    def save_checkpoint(self, path: str, step: int) -> None:
        os.makedirs(path, exist_ok=True)
        torch.save({"w": torch.ones(self.mib << 18)}, os.path.join(path, "engine_state.pt"))


class RaisingGroup:
    """Writes a part, then fails with ``error`` (what a worker's failed write reaches the driver as)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def save_checkpoint(self, path: str, step: int) -> None:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "part.bin"), "wb") as f:
            f.write(b"x" * 100)
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        OSError(errno.EDQUOT, "Disk quota exceeded"),
        RuntimeError(TORCH_SHORT_WRITE),
        RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
    ],
    ids=["enospc", "edquot", "torch_unexpected_pos", "torch_stream_writer"],
)
def test_disk_full_is_recognised_by_errno_or_torch_message_also_as_a_cause(error):
    assert is_disk_full(error)
    wrapped = RuntimeError("worker 0 failed")
    wrapped.__cause__ = error
    assert is_disk_full(wrapped)
    # negative controls: other failures are not a full disk
    assert not is_disk_full(RuntimeError("CUDA out of memory"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))


def _run_with_one_checkpoint(root: str):
    identity, _ = start_run(root, resume_mode="auto", resume_from_path=None, config=CONFIG)
    first = save_trainer_checkpoint(
        TensorGroup(1), root=root, step=1, trainer_state={"global_step": 1}, identity=identity
    )
    return identity, first


def test_a_torch_short_write_during_save_is_named_and_leaves_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "run")
    identity, first = _run_with_one_checkpoint(root)
    with pytest.raises(CheckpointDiskFullError, match=rf"no space to save checkpoint step 2 in .*{root}.* free"):
        save_trainer_checkpoint(
            RaisingGroup(RuntimeError(TORCH_SHORT_WRITE)), root=root, step=2, trainer_state={}, identity=identity
        )
    assert sorted(os.listdir(root)) == sorted(n for n in os.listdir(root) if not n.startswith(".staging"))
    assert not os.path.exists(os.path.join(root, ".staging_global_step_2"))
    verify_checkpoint(first)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 20 MiB tmpfs (root only: skipped where it cannot be mounted)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow  # starts another process
def test_a_real_full_disk_during_save_is_named_staging_removed_previous_kept(small_tmpfs):
    root = str(small_tmpfs / "run")
    identity, first = _run_with_one_checkpoint(root)
    with pytest.raises(CheckpointDiskFullError, match=rf"step 2 in .*{root}.*MiB free") as info:
        # 30 MiB into ~19 MiB free: the pre-check (the previous checkpoint took 1 MiB) lets it start
        save_trainer_checkpoint(TensorGroup(30), root=root, step=2, trainer_state={}, identity=identity)
    assert is_disk_full(info.value.__cause__)
    assert not os.path.exists(os.path.join(root, ".staging_global_step_2"))
    verify_checkpoint(first)
    assert os.statvfs(root).f_bavail * os.statvfs(root).f_frsize > 15 << 20  # the space was given back
    assert float(re.search(r"([0-9.]+) MiB free", str(info.value)).group(1)) > 15  # and the message says so


def test_a_run_log_on_a_full_disk_stops_the_file_and_keeps_the_console(tmp_path, monkeypatch):
    console = io.StringIO()
    monkeypatch.setattr(sys, "stdout", console)
    monkeypatch.setattr(sys, "stderr", console)
    log = RunLog().start()
    try:
        print("before the log file")
        log.open("/dev/full")  # every write fails with ENOSPC, as on a full disk
        for i in range(3):
            print(f"line {i}", flush=True)
        print("error: the run's own message", file=sys.stderr, flush=True)
    finally:
        log.close()
    text = console.getvalue()
    assert "line 2" in text and "error: the run's own message" in text
    assert text.count("warning: the run log /dev/full stopped: no space to write the run log") == 1
    with pytest.raises(OSError) as err:  # negative control: the plain file write fails with ENOSPC
        with open("/dev/full", "a") as f:
            f.write("x")
            f.flush()
    assert err.value.errno == errno.ENOSPC


def test_metrics_on_a_full_disk_is_a_named_error(tmp_path):
    tracking = Tracking("p", "e", log_dir=str(tmp_path), backends=["jsonl"])
    tracking._jsonl.close()
    tracking._jsonl = open("/dev/full", "a", encoding="utf-8")  # the metrics file's disk is full
    with pytest.raises(TrackingError, match=rf"no space to append step 3 to metrics.jsonl in '{tmp_path}' \(.* free\)"):
        tracking.log({"train/loss": 1.0}, step=3)
    tracking.close()  # the buffered record is dropped, not raised again


def test_a_full_disk_anywhere_in_a_run_is_a_named_user_error(tmp_path):
    from omegaconf import OmegaConf

    from verl_balance.trainer.driver import DriverBase, RunDiskFullError

    class FullAtStart(DriverBase):
        error: BaseException = OSError(errno.ENOSPC, "No space left on device")

        def __init__(self, cfg) -> None:
            raise self.error

    cfg = OmegaConf.create({"trainer": {"default_local_dir": str(tmp_path)}})
    with pytest.raises(RunDiskFullError, match=rf"no space to write the run files in '{tmp_path}' \(.* free\)"):
        FullAtStart.train(cfg)
    FullAtStart.error = OSError(errno.EACCES, "Permission denied")  # negative control: not a full disk
    with pytest.raises(PermissionError):
        FullAtStart.train(cfg)
