"""Saving a checkpoint (staging directory, trainer state, manifest last, rename into place), loading
the driver's state, and retention (``trainer.max_ckpt_to_keep``)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import traceback
from typing import NoReturn

from verl_balance.trainer.checkpoint.layout import (
    LATEST_FILE,
    RETIRING_PREFIX,
    STAGING_PREFIX,
    TRAINER_STATE_FILE,
    CheckpointDiskFullError,
    CheckpointError,
    checkpoint_dir,
    read_json,
    scan_checkpoints,
)
from verl_balance.trainer.checkpoint.lineage import RunIdentity
from verl_balance.trainer.checkpoint.manifest import group_hasher, write_complete_record
from verl_balance.utils.atomic_io import atomic_write_json, atomic_write_text, fsync_dir, refuse_symlink
from verl_balance.utils.disk import format_bytes, free_space, is_disk_full

logger = logging.getLogger(__name__)


def directory_size(path: str) -> int:
    """Bytes in the files under ``path``."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total


def _release_frames(err: BaseException) -> None:
    """Clear the local variables of the finished frames of ``err`` and its causes/contexts."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__


def _is_permission_denied(err: BaseException) -> bool:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, PermissionError) or (
            isinstance(err, OSError) and err.errno in (errno.EACCES, errno.EPERM, errno.EROFS)
        ):
            return True
        if "Permission denied" in str(err) or "Read-only file system" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _disk_full_error(root: str, step: int, *, needed: int | None) -> CheckpointDiskFullError:
    need = f"; the previous checkpoint took {format_bytes(needed)}" if needed else ""
    return CheckpointDiskFullError(
        f"no space to save checkpoint step {step} in trainer.default_local_dir={os.path.abspath(root)!r}: "
        f"{free_space(root)}{need}. The partial checkpoint was removed and the previous ones are intact. Free "
        "space there, lower trainer.max_ckpt_to_keep, or point trainer.default_local_dir at a larger disk"
    )


def save_trainer_checkpoint(
    group,
    *,
    root: str,
    step: int,
    trainer_state: dict,
    identity: RunIdentity,
    max_to_keep: int | None = None,
    protect: str | None = None,
) -> str:
    """Checkpoint workers and driver state as ``root/global_step_{step}``; returns its path.

    Written in a staging directory (``checkpoint_complete.json`` last) and renamed into place, so a stop
    at any point leaves the previous complete checkpoints untouched. Then deletes this lineage's
    checkpoints beyond the newest ``max_to_keep``, except ``protect``."""
    final = checkpoint_dir(root, step)
    staging = os.path.join(root, STAGING_PREFIX + os.path.basename(final))
    complete, _ = scan_checkpoints(root)
    needed = directory_size(complete[-1].path) if complete else None
    if needed and shutil.disk_usage(root).free < needed:
        raise _disk_full_error(root, step, needed=needed)
    for path in (staging, final, os.path.join(root, LATEST_FILE)):
        refuse_symlink(path)  # the workers would write their shards through a planted link
    if os.path.exists(staging):
        shutil.rmtree(staging)
    try:
        group.save_checkpoint(staging, step)
        atomic_write_json(os.path.join(staging, TRAINER_STATE_FILE), trainer_state)
        write_complete_record(
            staging, {**identity.to_dict(), "step": step, "time": time.time()}, hasher=group_hasher(group)
        )
    except Exception as err:
        _raise_save_error(err, root=root, staging=staging, step=step, needed=needed)
    _move_into_place(staging, final, root=root)
    fsync_dir(root)
    try:
        atomic_write_text(os.path.join(root, LATEST_FILE), str(step))
    except OSError as err:  # verl's informational marker; the checkpoint itself is complete
        if not is_disk_full(err):
            raise
        logger.warning("checkpoint: %s saved, but %s could not be written: %s", final, LATEST_FILE, err)
    if max_to_keep:
        prune_checkpoints(root, lineage_id=identity.lineage_id, keep=max_to_keep, protect=protect)
    return final


def _raise_save_error(err: Exception, *, root: str, staging: str, step: int, needed: int | None) -> NoReturn:
    """Re-raise a failed save: a full disk or read-only directory as one ``CheckpointError`` naming the fix."""
    if is_disk_full(err):  # no partial checkpoint is left filling the disk
        _release_frames(err)  # a writer held by the failed frames closes its file now (its space is freed)
        shutil.rmtree(staging, ignore_errors=True)
        raise _disk_full_error(root, step, needed=needed) from err
    if _is_permission_denied(err):
        raise CheckpointError(
            f"cannot save checkpoint step {step}: trainer.default_local_dir={os.path.abspath(root)!r} is not "
            "writable (permission denied while writing the checkpoint into it); the previous checkpoints are "
            "intact. Make the directory writable (or point trainer.default_local_dir elsewhere) and resume"
        ) from err
    raise err


def _move_into_place(staging: str, final: str, *, root: str) -> None:
    """Rename ``staging`` to ``final``; an existing ``final`` stays complete until the new one is in place."""
    if os.path.exists(final):
        retiring = os.path.join(root, RETIRING_PREFIX + os.path.basename(final))
        shutil.rmtree(retiring, ignore_errors=True)
        os.rename(final, retiring)
        os.rename(staging, final)
        shutil.rmtree(retiring)
    else:
        os.rename(staging, final)


def prune_checkpoints(root: str, *, lineage_id: str, keep: int, protect: str | None = None) -> list[str]:
    """Delete this lineage's complete checkpoints except the newest ``keep`` and ``protect``; returns the
    deleted paths. Other lineages and incomplete directories are never touched."""
    assert keep >= 1, keep
    own = [c for c in scan_checkpoints(root)[0] if c.lineage_id == lineage_id]
    protected = os.path.abspath(protect) if protect else None
    deleted = []
    for info in own[:-keep]:
        if os.path.abspath(info.path) == protected:
            continue
        retiring = os.path.join(root, RETIRING_PREFIX + "pruned_" + os.path.basename(info.path))
        os.rename(info.path, retiring)  # never a half-deleted directory under a global_step_N name
        shutil.rmtree(retiring)
        deleted.append(info.path)
    if deleted:
        fsync_dir(root)
        logger.info("checkpoint: trainer.max_ckpt_to_keep=%d, deleted %s", keep, deleted)
    return deleted


def load_trainer_checkpoint(group, path: str) -> dict:
    """Restore workers from ``path`` and return the driver's saved state."""
    state = read_json(os.path.join(path, TRAINER_STATE_FILE))
    if state is None:
        raise CheckpointError(
            f"trainer.resume_from_path={path!r} is not a complete checkpoint "
            f"(no readable {TRAINER_STATE_FILE}); pick a global_step_N directory"
        )
    group.load_checkpoint(path)
    return state
