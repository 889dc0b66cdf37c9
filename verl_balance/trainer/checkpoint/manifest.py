"""The checksum manifest of a checkpoint (``checkpoint_complete.json``: size and xxh3_128 of every
file) and its verification before anything loads the checkpoint."""

from __future__ import annotations

import logging
import os

from verl_balance.trainer.checkpoint.layout import (
    ALLOW_UNVERIFIED_KEY,
    COMPLETE_FILE,
    CheckpointCorruptError,
    CheckpointUnverifiedError,
    latest_checkpoint,
    move_aside,
    read_json,
    scan_checkpoints,
)
from verl_balance.utils import checksums
from verl_balance.utils.atomic_io import atomic_write_json

logger = logging.getLogger(__name__)


def group_hasher(group) -> checksums.Hasher:
    """A ``Hasher`` split over the worker group's ranks, or in-process for a group without that method."""
    method = getattr(group, "hash_checkpoint_files", None)
    if method is None:
        return checksums.local_hasher

    def hash_on_workers(root: str, sizes: dict[str, int]) -> dict[str, dict]:
        merged: dict[str, dict] = {}
        for part in method(root, sizes):
            merged.update(part)
        return merged

    return hash_on_workers


def write_complete_record(path: str, record: dict, *, hasher: checksums.Hasher = checksums.local_hasher) -> None:
    """Write ``path/checkpoint_complete.json`` last: ``record`` plus every other file's size and xxh3_128."""
    manifest = checksums.build_manifest(path, hasher=hasher)
    atomic_write_json(
        os.path.join(path, COMPLETE_FILE),
        {**record, "hash": checksums.HASH_NAME, checksums.MANIFEST_KEY: manifest},
    )


def verify_checkpoint(
    path: str, *, hasher: checksums.Hasher = checksums.local_hasher, allow_unverified: bool = False
) -> None:
    """Check the complete checkpoint ``path`` against its manifest before anything loads it; raises
    ``CheckpointCorruptError`` naming each missing, truncated or altered file, and
    ``CheckpointUnverifiedError`` for one without a manifest unless ``allow_unverified`` (then only the
    DCP shards' lengths are checked, with a warning)."""
    record = read_json(os.path.join(path, COMPLETE_FILE))
    manifest = (record or {}).get(checksums.MANIFEST_KEY)
    if manifest is None:
        _check_unverified(path, record=record, allow_unverified=allow_unverified)
        return
    try:
        checksums.verify_manifest(path, manifest, hasher=hasher)
    except checksums.ChecksumMismatchError as err:
        raise CheckpointCorruptError(str(err)) from err


def _check_unverified(path: str, *, record: dict | None, allow_unverified: bool) -> None:
    """Refuse the manifest-less checkpoint ``path`` unless ``allow_unverified`` (then check lengths and warn)."""
    what = (
        f"no readable {COMPLETE_FILE} (a save was stopped before it was sealed, or the directory was not "
        "written by the trainer)"
        if record is None
        else f"a {COMPLETE_FILE} without file checksums (an older version wrote it)"
    )
    if not allow_unverified:
        raise CheckpointUnverifiedError(
            f"checkpoint {path!r} has {what}: its files cannot be verified, so it is not loaded. Use a "
            f"complete global_step_N directory, or set {ALLOW_UNVERIFIED_KEY}=true to load it unverified"
        )
    problems = checksums.dcp_truncated_files(path)
    if problems:
        raise CheckpointCorruptError(f"checkpoint {path!r} is corrupt: {'; '.join(problems)}")
    logger.warning("checkpoint: %s has %s: loading it unverified (%s=true)", path, what, ALLOW_UNVERIFIED_KEY)


def newest_verified_checkpoint(
    root: str, *, lineage_id: str, hasher: checksums.Hasher = checksums.local_hasher, allow_unverified: bool = False
) -> str | None:
    """The newest complete checkpoint of ``lineage_id`` under ``root`` whose files verify; a corrupt one is
    moved to ``superseded/<time>_corrupt_global_step_N`` (never deleted) and the next older one tried."""
    newest = latest_checkpoint(root, lineage_id=lineage_id)  # warns about incomplete directories
    if newest is None:
        return None
    candidates = [c for c in scan_checkpoints(root)[0] if c.lineage_id == lineage_id]
    corrupt: list[tuple[str, CheckpointCorruptError]] = []
    for info in reversed(candidates):
        try:
            verify_checkpoint(info.path, hasher=hasher, allow_unverified=allow_unverified)
        except CheckpointCorruptError as err:
            logger.warning("checkpoint: %s", err)
            corrupt.append((info.path, err))
            continue
        for bad, err in corrupt:
            name = os.path.basename(bad)
            moved = move_aside(root, [name], label=f"corrupt_{name}")
            logger.warning("checkpoint: %s is corrupt (%s); moved to %s, resuming from %s", bad, err, moved, info.path)
        return info.path
    raise CheckpointCorruptError(
        f"no intact checkpoint of lineage {lineage_id} in {root!r}: "
        + " | ".join(str(err) for _, err in corrupt)
        + "; set trainer.resume_mode=disable to start fresh, or resume_path to pick another checkpoint"
    )
