"""The checkpoint directory's file names, the checkpoint errors, and scanning a directory for
complete and incomplete ``global_step_N`` checkpoints (layout: ``trainer/checkpoint/__init__.py``)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import time

from verl_balance.trainer.checkpoint.resume_policy import ResumeConfigError
from verl_balance.trainer.config import ConfigError
from verl_balance.utils import checksums
from verl_balance.utils.atomic_io import fsync_dir, open_nofollow, refuse_symlink

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
TRAINER_STATE_FILE = "trainer_state.json"
COMPLETE_FILE = checksums.COMPLETE_FILE  # "checkpoint_complete.json"
LINEAGE_FILE = "run_lineage.json"
SUPERSEDED_DIR = "superseded"
STAGING_PREFIX = ".staging_"
RETIRING_PREFIX = ".retiring_"
STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(ConfigError):
    """The checkpoint directory holds something the run cannot continue from, or cannot be written."""


class CheckpointDiskFullError(CheckpointError):
    """A checkpoint does not fit on the disk of ``trainer.default_local_dir``."""


class CheckpointCorruptError(CheckpointError):
    """A complete checkpoint whose files no longer match their manifest (missing, resized, altered)."""


class CheckpointUnverifiedError(CheckpointError):
    """A checkpoint without a verified manifest: refused unless ``trainer.allow_unverified_checkpoint=true``."""


ALLOW_UNVERIFIED_KEY = "trainer.allow_unverified_checkpoint"


class LineageFileError(CheckpointError):
    """``run_lineage.json`` exists but cannot be used (unreadable, not JSON, or lacking its keys)."""


class ResumeKeyChangedError(CheckpointError, ResumeConfigError):
    """A resume changes a key the saved state cannot follow (its ``on_resume`` policy is refuse)."""


def read_json(path: str) -> dict | None:
    """The JSON object in ``path``; None when missing, empty, torn, or a (hard or symbolic) link."""
    try:
        with open_nofollow(path, "r") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# ---------------------------------------------------------------------- scanning
@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: its directory, step and completeness record."""

    path: str
    step: int
    record: dict

    @property
    def lineage_id(self) -> str | None:
        """The lineage that wrote it (None for checkpoints of older versions without one)."""
        return self.record.get("lineage_id")


def checkpoint_dir(root: str, step: int) -> str:
    """``root/global_step_{step}``."""
    return os.path.join(root, f"global_step_{step}")


def is_complete(path: str) -> bool:
    """Whether ``path`` holds a completeness record (written last by ``save_trainer_checkpoint``)."""
    return read_json(os.path.join(path, COMPLETE_FILE)) is not None


def _recover_interrupted_renames(root: str) -> None:
    """Finish a save stopped between its renames (complete staging moved into place, half-pruned removed)."""
    for name in os.listdir(root):
        if name.startswith(RETIRING_PREFIX + "pruned_"):  # a deletion stopped half-way: finish it
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for prefix in (STAGING_PREFIX, RETIRING_PREFIX):
        for name in sorted(os.listdir(root)):
            if not name.startswith(prefix):
                continue
            final = os.path.join(root, name[len(prefix) :])
            source = os.path.join(root, name)
            if STEP_DIR.match(name[len(prefix) :]) and not os.path.exists(final) and is_complete(source):
                logger.warning("checkpoint: finishing an interrupted save, %s -> %s", source, final)
                os.rename(source, final)
                fsync_dir(root)


def scan_checkpoints(root: str) -> tuple[list[CheckpointInfo], list[str]]:
    """(complete checkpoints sorted by step, incomplete ``global_step_N``/staging directories)."""
    if not os.path.isdir(root):
        return [], []
    _recover_interrupted_renames(root)
    complete, incomplete = [], []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        match = STEP_DIR.match(name)
        if match and os.path.isdir(path):
            record = read_json(os.path.join(path, COMPLETE_FILE))
            if record is None:
                incomplete.append(path)
            else:
                complete.append(CheckpointInfo(path=path, step=int(match.group(1)), record=record))
        elif name.startswith(STAGING_PREFIX):
            incomplete.append(path)
    complete.sort(key=lambda c: c.step)
    return complete, sorted(incomplete)


def latest_checkpoint(root: str, *, lineage_id: str | None = None) -> str | None:
    """The newest complete checkpoint under ``root`` (of ``lineage_id`` if given); incomplete ones skipped, warned."""
    complete, incomplete = scan_checkpoints(root)
    if lineage_id is not None:
        complete = [c for c in complete if c.lineage_id == lineage_id]
    newest = complete[-1] if complete else None
    for path in incomplete:
        logger.warning(
            "checkpoint: %s is incomplete (a save was interrupted) and is ignored%s",
            path,
            f"; using {newest.path}" if newest else "",
        )
    return newest.path if newest else None


def move_aside(root: str, names: list[str], *, label: str) -> str | None:
    """Move ``names`` (entries of ``root``) into ``root/superseded/<time>_<label>/``; returns it."""
    names = [n for n in names if os.path.exists(os.path.join(root, n))]
    if not names:
        return None
    refuse_symlink(os.path.join(root, SUPERSEDED_DIR))  # never move checkpoints through a planted link
    dest = os.path.join(root, SUPERSEDED_DIR, f"{time.strftime('%Y%m%d-%H%M%S')}_{label}")
    refuse_symlink(dest)
    os.makedirs(dest, exist_ok=True)
    for name in names:
        os.rename(os.path.join(root, name), os.path.join(dest, name))
    fsync_dir(root)
    return dest


def checkpoint_step(path: str) -> int:
    """The step of the checkpoint ``path``: from its record, else its trainer state, else its name."""
    record = read_json(os.path.join(path, COMPLETE_FILE))
    if record is not None and "step" in record:
        return int(record["step"])
    state = read_json(os.path.join(path, TRAINER_STATE_FILE))
    if state is not None and "global_step" in state:
        return int(state["global_step"])
    match = STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if match:
        return int(match.group(1))
    raise CheckpointError(f"cannot tell the step of checkpoint {path!r}")
