"""Checkpoint bookkeeping on the driver: ``global_step_N`` directories, run lineage, retention and
the driver's own state beside the workers' sharded engine state.

Layout of ``trainer.default_local_dir``::

    .run.lock                         the live run's OS lock and its owner (run_lock.py)
    run_lineage.json                  which lineage owns the directory now (written at run start)
    latest_checkpointed_iteration.txt verl's marker (informational: resume never trusts it)
    global_step_N/                    complete checkpoints: engine shards, trainer_state.json and,
                                      written last, checkpoint_complete.json (identity + lineage)
    .staging_global_step_N/           a save in progress (renamed to global_step_N when complete)
    superseded/<time>_<lineage>/      another lineage's checkpoints and metrics, moved aside
    metrics.jsonl                     this lineage's metrics, truncated to the resumed step

Guarantees: a checkpoint is visible under ``global_step_N`` only once complete (written to a
staging directory, then renamed); a complete checkpoint is never removed before a newer one is
complete; small state files are written to a temporary file, fsynced and renamed; ``auto`` resume
picks the newest complete checkpoint *of the directory's lineage* and never one of another run.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping

from verl_balance.trainer.config import RESUME_MODES, ConfigError, SFTConfig
from verl_balance.trainer.resume_policy import (
    APPLY,
    REFUSE,
    ResumeConfigError,
    changed_keys,
    policy_of,
    resume_policies,
)
from verl_balance.utils import checksums
from verl_balance.utils.atomic_io import atomic_write_json, atomic_write_text, fsync_dir
from verl_balance.utils.tracking import METRICS_FILE, rewrite_metrics_up_to

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
TRAINER_STATE_FILE = "trainer_state.json"
COMPLETE_FILE = checksums.COMPLETE_FILE  # "checkpoint_complete.json"
LINEAGE_FILE = "run_lineage.json"
SUPERSEDED_DIR = "superseded"
STAGING_PREFIX = ".staging_"
RETIRING_PREFIX = ".retiring_"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(ConfigError):
    """The checkpoint directory holds something the run cannot continue from, or cannot be written."""


class CheckpointDiskFullError(CheckpointError):
    """A checkpoint does not fit on the disk of ``trainer.default_local_dir``."""


class CheckpointCorruptError(CheckpointError):
    """A complete checkpoint whose files no longer match their manifest (missing, resized, altered)."""


class LineageFileError(CheckpointError):
    """``run_lineage.json`` exists but cannot be used (unreadable, not JSON, or lacking its keys)."""


class ResumeKeyChangedError(CheckpointError, ResumeConfigError):
    """A resume changes a key the saved state cannot follow (its ``on_resume`` policy is refuse)."""


def _read_json(path: str) -> dict | None:
    """The JSON object in ``path``; None when missing, empty or torn."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# ---------------------------------------------------------------------- identity and lineage
@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """Who wrote a checkpoint: this process's run, the lineage it continues and where it started.

    A lineage is a chain of runs that resumed one another (``auto``); ``disable`` and
    ``resume_path`` start a new one. ``branch_checkpoint`` is the checkpoint the lineage started
    from (``resume_path``), so a lineage killed before its first save restarts from there.
    """

    run_id: str
    lineage_id: str
    start_step: int
    branch_checkpoint: str | None
    config_hash: str

    def to_dict(self) -> dict:
        """Plain dict for the JSON files."""
        return dataclasses.asdict(self)


def flatten_config(config: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out = {}
    for key, value in (config or {}).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_config(value, name + "."))
        else:
            out[name] = value
    return out


def trajectory_config(config: dict, *, policies: Mapping[str, str] | None = None) -> dict:
    """The flattened config restricted to the keys a resume may not change (``on_resume`` policy
    refuse; ``policies`` from ``resume_policy.resume_policies``, default the SFT recipe's)."""
    policies = policies if policies is not None else resume_policies(SFTConfig)
    return {k: v for k, v in flatten_config(config).items() if policy_of(k, policies) == REFUSE}


def config_hash(config: dict, *, policies: Mapping[str, str] | None = None) -> str:
    """Short stable hash of ``trajectory_config(config)``."""
    blob = json.dumps(trajectory_config(config, policies=policies), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_LINEAGE_KEYS = ("lineage_id", "run_id", "start_step")


def read_lineage(root: str) -> dict | None:
    """The directory's ``run_lineage.json``; None when absent. LineageFileError naming the file and
    what is wrong when it is present but unreadable, not a JSON object, or lacks its keys."""
    path = os.path.join(root, LINEAGE_FILE)
    if not os.path.exists(path):
        return None
    fix = (
        "restore it, or set trainer.resume_mode=disable (the directory's checkpoints and this file are "
        "moved to superseded/) or trainer.resume_mode=resume_path with trainer.resume_from_path=<a checkpoint>"
    )
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as err:
        raise LineageFileError(f"{path} cannot be read as JSON ({err}); {fix}") from err
    if not isinstance(value, dict):
        raise LineageFileError(f"{path} holds a {type(value).__name__}, not a JSON object; {fix}")
    missing = [k for k in _LINEAGE_KEYS if k not in value]
    if missing:
        raise LineageFileError(f"{path} lacks the key(s) {missing} (it has {sorted(value)}); {fix}")
    return value


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
    return _read_json(os.path.join(path, COMPLETE_FILE)) is not None


def _recover_interrupted_renames(root: str) -> None:
    """Finish a save stopped between its renames: a complete staging (or retiring) directory
    whose ``global_step_N`` is missing is moved into place; a half-deleted pruned one is removed."""
    for name in os.listdir(root):
        if name.startswith(RETIRING_PREFIX + "pruned_"):  # a deletion stopped half-way: finish it
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    for prefix in (STAGING_PREFIX, RETIRING_PREFIX):
        for name in sorted(os.listdir(root)):
            if not name.startswith(prefix):
                continue
            final = os.path.join(root, name[len(prefix) :])
            source = os.path.join(root, name)
            if _STEP_DIR.match(name[len(prefix) :]) and not os.path.exists(final) and is_complete(source):
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
        match = _STEP_DIR.match(name)
        if match and os.path.isdir(path):
            record = _read_json(os.path.join(path, COMPLETE_FILE))
            if record is None:
                incomplete.append(path)
            else:
                complete.append(CheckpointInfo(path=path, step=int(match.group(1)), record=record))
        elif name.startswith(STAGING_PREFIX):
            incomplete.append(path)
    complete.sort(key=lambda c: c.step)
    return complete, sorted(incomplete)


def latest_checkpoint(root: str, *, lineage_id: str | None = None) -> str | None:
    """The newest complete checkpoint under ``root`` (of ``lineage_id`` when given).

    Incomplete directories (a save that was stopped) are skipped with a warning, so an older
    complete checkpoint is used rather than none."""
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


# ---------------------------------------------------------------------- run start
def _move_aside(root: str, names: list[str], *, label: str) -> str | None:
    """Move ``names`` (entries of ``root``) into ``root/superseded/<time>_<label>/``; returns it."""
    names = [n for n in names if os.path.exists(os.path.join(root, n))]
    if not names:
        return None
    dest = os.path.join(root, SUPERSEDED_DIR, f"{time.strftime('%Y%m%d-%H%M%S')}_{label}")
    os.makedirs(dest, exist_ok=True)
    for name in names:
        os.rename(os.path.join(root, name), os.path.join(dest, name))
    fsync_dir(root)
    return dest


def check_resume_config(lineage: dict, config: dict, *, policies: Mapping[str, str]) -> None:
    """Refuse a resume that changes a key with policy refuse (ResumeKeyChangedError naming each such
    key, its old and new value); log the applied changes (they take effect from the next step).
    Keys absent from the recorded config (added by a newer version) are not compared."""
    old, new = flatten_config(lineage.get("config") or {}), flatten_config(config)
    # A key absent from the record was added by a newer version after the lineage started: not compared.
    changed = [k for k in changed_keys(old, new) if k in old]
    refused = [k for k in changed if policy_of(k, policies) == REFUSE]
    if refused:
        shown = "; ".join(f"{k}: {old.get(k, '<absent>')!r} -> {new.get(k, '<absent>')!r}" for k in refused)
        raise ResumeKeyChangedError(
            f"cannot resume lineage {lineage.get('lineage_id')} with a changed {', '.join(refused)} ({shown}): "
            "the saved state was made with the old value. Resume with the old value, or start a new run "
            "(trainer.resume_mode=disable, or resume_path to branch from a checkpoint). Keys that may change "
            "on resume: docs/fault_tolerance.md"
        )
    applied = [k for k in changed if policy_of(k, policies) == APPLY]
    if applied:
        logger.warning(
            "resuming lineage %s with changed key(s), applied from the next step: %s",
            lineage.get("lineage_id"),
            "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in applied),
        )


def _start_from_path(
    root: str, *, resume_from_path: str | None, complete: list, incomplete: list, hasher: checksums.Hasher, run_id: str
) -> tuple[str, str, str]:
    """``resume_path``: a new lineage branching from the verified ``resume_from_path``; this
    directory's checkpoints past its step (another branch's future) are moved to ``superseded/``.
    Returns (load_path, lineage_id, branch)."""
    if not resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    load_path = os.path.abspath(resume_from_path)
    if not (is_complete(load_path) or os.path.exists(os.path.join(load_path, TRAINER_STATE_FILE))):
        raise CheckpointError(
            f"trainer.resume_from_path={resume_from_path!r} is not a complete checkpoint "
            f"(no {COMPLETE_FILE}); pick a complete global_step_N directory"
        )
    try:
        verify_checkpoint(load_path, hasher=hasher)
    except CheckpointCorruptError as err:  # the user named this one: never silently use another
        raise CheckpointCorruptError(f"trainer.resume_from_path={resume_from_path!r}: {err}") from err
    start = _checkpoint_step(load_path)
    lineage_id, branch = run_id, load_path
    later = [os.path.basename(c.path) for c in complete if c.step > start and c.path != load_path]
    later += [os.path.basename(p) for p in incomplete]
    same_dir = os.path.dirname(load_path) == os.path.abspath(root)
    moved = _move_aside(root, later + ([] if same_dir else [METRICS_FILE]) + [LATEST_FILE], label=f"after_step_{start}")
    if moved:
        logger.warning(
            "trainer.resume_mode=resume_path: checkpoints past step %d (another branch) moved to %s", start, moved
        )
    return load_path, lineage_id, branch


@dataclasses.dataclass(frozen=True)
class _RunStart:
    """What each resume mode reads: the directory and its scan, this run's id, the lineage record
    (None when absent, or broken outside ``auto``) and how to check a config change."""

    root: str
    run_id: str
    lineage: dict | None
    complete: list[CheckpointInfo]
    incomplete: list[str]
    config: dict
    policies: Mapping[str, str]
    hasher: checksums.Hasher
    resume_from_path: str | None


# Each mode returns (checkpoint to load or None, lineage id, branch checkpoint of the lineage).
_Start = tuple[str | None, str, str | None]


def _start_auto(run: _RunStart) -> _Start:
    """``auto``: continue the recorded lineage from its newest verified checkpoint (or, with none
    yet, from the checkpoint it branched from); checkpoints of other runs are never picked. Without
    a lineage record, a new lineage, refused when the directory holds checkpoints (of an unknown run)."""
    if run.lineage is None:
        return _start_without_lineage(run)
    lineage_id = run.lineage["lineage_id"]
    branch = run.lineage.get("branch_checkpoint")
    load_path = newest_verified_checkpoint(run.root, lineage_id=lineage_id, hasher=run.hasher)
    if load_path is None and branch is not None:
        if not (is_complete(branch) or os.path.exists(os.path.join(branch, TRAINER_STATE_FILE))):
            raise CheckpointError(
                f"lineage {lineage_id} in trainer.default_local_dir={run.root!r} started from "
                f"{branch!r}, which is no longer a complete checkpoint"
            )
        verify_checkpoint(branch, hasher=run.hasher)
        load_path = branch
    if load_path is not None:  # with nothing saved yet there is no state to contradict
        check_resume_config(run.lineage, run.config, policies=run.policies)
    return load_path, lineage_id, branch


def _start_without_lineage(run: _RunStart) -> _Start:
    """``auto`` in a directory without ``run_lineage.json``: an error when it holds checkpoints
    (say ``resume_path`` or ``disable``); an unknown run's metrics are moved aside."""
    foreign = [c.path for c in run.complete] + [p for p in run.incomplete if _STEP_DIR.match(os.path.basename(p))]
    if foreign:
        raise CheckpointError(
            f"trainer.default_local_dir={run.root!r} holds checkpoints of another run ({len(foreign)}, e.g. "
            f"{max(foreign)!r}) but no {LINEAGE_FILE} saying which run they belong to; set "
            "trainer.resume_mode=resume_path trainer.resume_from_path=<one of them> to continue it, or "
            "trainer.resume_mode=disable to start fresh (they are moved to superseded/, not deleted)"
        )
    if os.path.exists(os.path.join(run.root, METRICS_FILE)):
        moved = _move_aside(run.root, [METRICS_FILE], label="no-lineage")
        logger.warning("metrics.jsonl of an unknown run moved to %s", moved)
    return None, run.run_id, None


def _start_disabled(run: _RunStart) -> _Start:
    """``disable``: a new lineage from step 0; the directory's checkpoints, lineage record and
    metrics are moved to ``superseded/`` (nothing is deleted)."""
    names = [os.path.basename(c.path) for c in run.complete] + [os.path.basename(p) for p in run.incomplete]
    names += [LINEAGE_FILE, METRICS_FILE, LATEST_FILE]
    moved = _move_aside(run.root, names, label=(run.lineage or {}).get("lineage_id", "unknown"))
    if moved:
        logger.warning(
            "trainer.resume_mode=disable: the previous run's checkpoints and metrics in %s were moved to %s",
            run.root,
            moved,
        )
    return None, run.run_id, None


def _start_from_path(run: _RunStart) -> _Start:
    """``resume_path``: a new lineage branching from the verified ``resume_from_path`` (corrupt: an
    error naming the file); this directory's checkpoints past its step (another branch's future)
    are moved to ``superseded/``."""
    if not run.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    load_path = os.path.abspath(run.resume_from_path)
    if not (is_complete(load_path) or os.path.exists(os.path.join(load_path, TRAINER_STATE_FILE))):
        raise CheckpointError(
            f"trainer.resume_from_path={run.resume_from_path!r} is not a complete checkpoint "
            f"(no {COMPLETE_FILE}); pick a complete global_step_N directory"
        )
    try:
        verify_checkpoint(load_path, hasher=run.hasher)
    except CheckpointCorruptError as err:  # the user named this one: never silently use another
        raise CheckpointCorruptError(f"trainer.resume_from_path={run.resume_from_path!r}: {err}") from err
    start = _checkpoint_step(load_path)
    later = [os.path.basename(c.path) for c in run.complete if c.step > start and c.path != load_path]
    later += [os.path.basename(p) for p in run.incomplete]
    same_dir = os.path.dirname(load_path) == os.path.abspath(run.root)
    moved = _move_aside(
        run.root, later + ([] if same_dir else [METRICS_FILE]) + [LATEST_FILE], label=f"after_step_{start}"
    )
    if moved:
        logger.warning(
            "trainer.resume_mode=resume_path: checkpoints past step %d (another branch) moved to %s", start, moved
        )
    return load_path, run.run_id, load_path


_MODE_STARTS = {"auto": _start_auto, "disable": _start_disabled, "resume_path": _start_from_path}
assert set(_MODE_STARTS) == set(RESUME_MODES), (_MODE_STARTS, RESUME_MODES)


def start_run(
    root: str,
    *,
    resume_mode: str,
    resume_from_path: str | None,
    config: dict,
    schema: type | None = None,
    hasher: checksums.Hasher = checksums.local_hasher,
) -> tuple[RunIdentity, str | None]:
    """Decide this run's lineage and the checkpoint to load (None: start from the beginning).

    ``resume_mode`` picks ``_start_auto`` (continue this directory's lineage), ``_start_disabled``
    (a new lineage from step 0, the old one moved to ``superseded/``, nothing deleted) or
    ``_start_from_path`` (a new lineage branching from ``resume_from_path``). The checkpoint to
    load is verified against its checksums first (``verify_checkpoint``, hashing with ``hasher``).

    ``auto`` compares ``config`` with the lineage's recorded config by the ``on_resume`` policies
    of ``schema`` (the recipe's dataclass, default SFTConfig; see resume_policy.py): a changed
    refused key is an error, applied keys are logged. A ``run_lineage.json`` that is present but
    broken is an error in ``auto`` (LineageFileError) and moved aside by ``disable``.

    Writes the new ``run_lineage.json`` (atomically) and makes ``metrics.jsonl`` hold only this
    lineage's records up to the start step.
    """
    if resume_mode not in RESUME_MODES:
        raise ConfigError(f"trainer.resume_mode={resume_mode!r} is not valid; expected one of {list(RESUME_MODES)}")
    os.makedirs(root, exist_ok=True)
    policies = resume_policies(schema if dataclasses.is_dataclass(schema) else SFTConfig)
    try:
        lineage = read_lineage(root)
    except LineageFileError:
        if resume_mode == "auto":
            raise
        lineage = None  # disable / resume_path start a new lineage; disable moves the file aside
    complete, incomplete = scan_checkpoints(root)
    run = _RunStart(
        root=root,
        run_id=uuid.uuid4().hex[:12],
        lineage=lineage,
        complete=complete,
        incomplete=incomplete,
        config=config,
        policies=policies,
        hasher=hasher,
        resume_from_path=resume_from_path,
    )
    load_path, lineage_id, branch = _MODE_STARTS[resume_mode](run)
    identity = RunIdentity(
        run_id=run.run_id,
        lineage_id=lineage_id,
        start_step=_checkpoint_step(load_path) if load_path else 0,
        branch_checkpoint=branch,
        config_hash=config_hash(config, policies=policies),
    )
    _record_start(root, identity=identity, config=config)
    return identity, load_path


def _record_start(root: str, *, identity: RunIdentity, config: dict) -> None:
    """Write the new ``run_lineage.json`` (atomically) and cut ``metrics.jsonl`` to the start step."""
    atomic_write_json(
        os.path.join(root, LINEAGE_FILE), {**identity.to_dict(), "config": config, "started": time.time()}
    )
    metrics_path = os.path.join(root, METRICS_FILE)
    if os.path.exists(metrics_path):
        rewrite_metrics_up_to(metrics_path, identity.start_step)


def _checkpoint_step(path: str) -> int:
    record = _read_json(os.path.join(path, COMPLETE_FILE))
    if record is not None and "step" in record:
        return int(record["step"])
    state = _read_json(os.path.join(path, TRAINER_STATE_FILE))
    if state is not None and "global_step" in state:
        return int(state["global_step"])
    match = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if match:
        return int(match.group(1))
    raise CheckpointError(f"cannot tell the step of checkpoint {path!r}")


# ---------------------------------------------------------------------- save, load, retention
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


def _is_disk_full(err: BaseException) -> bool:
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        if "No space left" in text or "Disk quota exceeded" in text or "PytorchStreamWriter failed" in text:
            return True
        err = err.__cause__ or err.__context__
    return False


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


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _disk_full_error(root: str, step: int, *, needed: int | None) -> CheckpointDiskFullError:
    free = shutil.disk_usage(root).free
    need = f"; the previous checkpoint took {_format_bytes(needed)}" if needed else ""
    return CheckpointDiskFullError(
        f"no space to save checkpoint step {step} in trainer.default_local_dir={os.path.abspath(root)!r}: "
        f"{_format_bytes(free)} free{need}. Free space there, lower trainer.max_ckpt_to_keep, or point "
        "trainer.default_local_dir at a larger disk"
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

    Workers write their shards into a staging directory; the driver adds ``trainer_state.json``
    and, last, ``checkpoint_complete.json``, then renames the directory into place. A stop at any
    point leaves the previous complete checkpoints untouched. Afterwards checkpoints of this
    lineage beyond the newest ``max_to_keep`` are deleted, except ``protect``.
    """
    final = checkpoint_dir(root, step)
    staging = os.path.join(root, STAGING_PREFIX + os.path.basename(final))
    complete, _ = scan_checkpoints(root)
    needed = directory_size(complete[-1].path) if complete else None
    if needed and shutil.disk_usage(root).free < needed:
        raise _disk_full_error(root, step, needed=needed)
    if os.path.exists(staging):
        shutil.rmtree(staging)
    try:
        group.save_checkpoint(staging, step)
        atomic_write_json(os.path.join(staging, TRAINER_STATE_FILE), trainer_state)
        write_complete_record(
            staging, {**identity.to_dict(), "step": step, "time": time.time()}, hasher=group_hasher(group)
        )
    except Exception as err:
        if _is_disk_full(err):
            shutil.rmtree(staging, ignore_errors=True)
            raise _disk_full_error(root, step, needed=needed) from err
        if _is_permission_denied(err):
            raise CheckpointError(
                f"cannot save checkpoint step {step}: trainer.default_local_dir={os.path.abspath(root)!r} is not "
                "writable (permission denied while writing the checkpoint into it); the previous checkpoints are "
                "intact. Make the directory writable (or point trainer.default_local_dir elsewhere) and resume"
            ) from err
        raise
    if os.path.exists(final):
        # Replacing a checkpoint of the same step: the old one stays complete until the new is in place.
        retiring = os.path.join(root, RETIRING_PREFIX + os.path.basename(final))
        shutil.rmtree(retiring, ignore_errors=True)
        os.rename(final, retiring)
        os.rename(staging, final)
        shutil.rmtree(retiring)
    else:
        os.rename(staging, final)
    fsync_dir(root)
    atomic_write_text(os.path.join(root, LATEST_FILE), str(step))
    if max_to_keep:
        prune_checkpoints(root, lineage_id=identity.lineage_id, keep=max_to_keep, protect=protect)
    return final


def prune_checkpoints(root: str, *, lineage_id: str, keep: int, protect: str | None = None) -> list[str]:
    """Delete this lineage's complete checkpoints except the newest ``keep`` and ``protect`` (the
    trainer's last checkpoint known to be finite); returns the deleted paths.

    Other lineages' checkpoints (and incomplete directories) are never touched."""
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
    state = _read_json(os.path.join(path, TRAINER_STATE_FILE))
    if state is None:
        raise CheckpointError(
            f"trainer.resume_from_path={path!r} is not a complete checkpoint "
            f"(no readable {TRAINER_STATE_FILE}); pick a global_step_N directory"
        )
    group.load_checkpoint(path)
    return state


# ---------------------------------------------------------------------- checksums and verification
def group_hasher(group) -> checksums.Hasher:
    """A ``Hasher`` that splits the hashing over the worker group's ranks (``hash_checkpoint_files``),
    or hashes in this process for a group without that method."""
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
    """Write ``path/checkpoint_complete.json`` (last: it marks the checkpoint complete) holding
    ``record`` plus the size and xxh3_128 checksum of every other file under ``path``."""
    manifest = checksums.build_manifest(path, hasher=hasher)
    atomic_write_json(
        os.path.join(path, COMPLETE_FILE),
        {**record, "hash": checksums.HASH_NAME, checksums.MANIFEST_KEY: manifest},
    )


def verify_checkpoint(path: str, *, hasher: checksums.Hasher = checksums.local_hasher) -> None:
    """Check the files of the complete checkpoint ``path`` against its manifest before anything
    loads them; raises ``CheckpointCorruptError`` naming each missing, truncated or altered file.

    A checkpoint written before manifests existed is loaded *unverified* (a warning): only its DCP
    shards' lengths are checked against their ``.metadata``."""
    record = _read_json(os.path.join(path, COMPLETE_FILE))
    manifest = (record or {}).get(checksums.MANIFEST_KEY)
    if manifest is None:
        problems = checksums.dcp_truncated_files(path)
        if problems:
            raise CheckpointCorruptError(f"checkpoint {path!r} is corrupt: {'; '.join(problems)}")
        logger.warning(
            "checkpoint: %s has no file checksums (written by an older version): loading it unverified", path
        )
        return
    try:
        checksums.verify_manifest(path, manifest, hasher=hasher)
    except checksums.ChecksumMismatchError as err:
        raise CheckpointCorruptError(str(err)) from err


def newest_verified_checkpoint(
    root: str, *, lineage_id: str, hasher: checksums.Hasher = checksums.local_hasher
) -> str | None:
    """The newest complete checkpoint of ``lineage_id`` under ``root`` whose files verify.

    A corrupt one is moved to ``superseded/<time>_corrupt_global_step_N`` (never deleted) with a
    warning naming the bad files, and the next older one of the lineage is tried."""
    newest = latest_checkpoint(root, lineage_id=lineage_id)  # warns about incomplete directories
    if newest is None:
        return None
    candidates = [c for c in scan_checkpoints(root)[0] if c.lineage_id == lineage_id]
    corrupt: list[tuple[str, CheckpointCorruptError]] = []
    for info in reversed(candidates):
        try:
            verify_checkpoint(info.path, hasher=hasher)
        except CheckpointCorruptError as err:
            logger.warning("checkpoint: %s", err)
            corrupt.append((info.path, err))
            continue
        for bad, err in corrupt:
            name = os.path.basename(bad)
            moved = _move_aside(root, [name], label=f"corrupt_{name}")
            logger.warning("checkpoint: %s is corrupt (%s); moved to %s, resuming from %s", bad, err, moved, info.path)
        return info.path
    raise CheckpointCorruptError(
        f"no intact checkpoint of lineage {lineage_id} in {root!r}: "
        + " | ".join(str(err) for _, err in corrupt)
        + "; set trainer.resume_mode=disable to start fresh, or resume_path to pick another checkpoint"
    )
