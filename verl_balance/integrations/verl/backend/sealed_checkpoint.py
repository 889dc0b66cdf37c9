"""The verl backend's checkpoint completeness record: what ``trainer/checkpoint`` does for our own
trainers, for the directories verl's trainer asks the engine to save and load.

A save first removes any old ``checkpoint_complete.json`` (so a save stopped half-way never looks
complete), writes the shards and, after every rank finished, rank 0 writes the record with the size
and xxh3_128 of every file (``utils/checksums.py``). A load verifies the files against it on rank 0
before any rank reads them; a directory without a record (or without checksums) is refused unless
``VERL_BALANCE_ALLOW_UNVERIFIED_CHECKPOINT=1`` (checkpoints of older versions), and the verdict
reaches every rank, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import json
import logging
import os
import time

import torch.distributed as dist

from verl_balance.utils import checksums
from verl_balance.utils.atomic_io import atomic_write_json, open_nofollow

logger = logging.getLogger(__name__)

ALLOW_UNVERIFIED_ENV = "VERL_BALANCE_ALLOW_UNVERIFIED_CHECKPOINT"


class CheckpointVerifyError(ValueError):
    """A verl-backend checkpoint without a verified completeness record, or whose files changed."""


def unseal(path: str) -> None:
    """Rank 0: remove ``path``'s record before a save overwrites the directory's files."""
    if dist.get_rank() == 0:
        record = os.path.join(path, checksums.COMPLETE_FILE)
        if os.path.lexists(record):
            os.remove(record)


def _hash_across_ranks(root: str, sizes: dict[str, int], *, group=None) -> dict[str, dict]:
    """Every rank of ``group`` hashes its share of rank 0's ``sizes``; every rank gets the union."""
    share = [sizes]
    dist.broadcast_object_list(share, group=group, group_src=0)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = checksums.hash_files(root, checksums.share_of(share[0], rank=rank, world=world))
    parts = [None] * world
    dist.all_gather_object(parts, mine, group=group)
    return {name: digest for part in parts for name, digest in part.items()}


def seal(path: str, *, step: int, group=None) -> None:
    """After every rank wrote its files: the ranks hash their shares of them, then rank 0 writes
    the record (last) and all ranks meet."""
    dist.barrier(group=group)
    is_writer = dist.get_rank(group) == 0
    sizes = checksums.list_files(path) if is_writer else {}
    digests = _hash_across_ranks(path, sizes, group=group)
    if is_writer:
        manifest = {
            name: {"size": sizes[name], checksums.HASH_NAME: digests[name][checksums.HASH_NAME]} for name in sizes
        }
        record = {"step": step, "time": time.time(), "hash": checksums.HASH_NAME, checksums.MANIFEST_KEY: manifest}
        atomic_write_json(os.path.join(path, checksums.COMPLETE_FILE), record)
    dist.barrier(group=group)


def _problem(path: str) -> str | None:
    """Why ``path`` may not be loaded (None: verified, or unverified by the explicit opt-in)."""
    record_path = os.path.join(path, checksums.COMPLETE_FILE)
    try:
        with open_nofollow(record_path, "r") as f:  # a planted link counts as no record
            record = json.load(f)
    except (OSError, ValueError):
        record = None
    manifest = record.get(checksums.MANIFEST_KEY) if isinstance(record, dict) else None
    if manifest is None:
        if os.environ.get(ALLOW_UNVERIFIED_ENV) == "1":
            logger.warning("checkpoint %s has no verified %s: loading it unverified", path, checksums.COMPLETE_FILE)
            return None
        return (
            f"checkpoint {path!r} has no verified {record_path} (a save was stopped, or an older version wrote "
            f"it): refused. Load a complete checkpoint, or set {ALLOW_UNVERIFIED_ENV}=1 to load it unverified"
        )
    try:
        checksums.verify_manifest(path, manifest)
    except checksums.ChecksumMismatchError as err:
        return str(err)
    return None


def verify_sealed(path: str, *, group=None) -> None:
    """Rank 0 checks ``path``'s record and files; every rank raises ``CheckpointVerifyError`` on a problem."""
    box = [_problem(path) if dist.get_rank(group) == 0 else None]
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(box, group=group, group_src=0)
    if box[0] is not None:
        raise CheckpointVerifyError(box[0])
