"""Run lineage and start-up: which lineage owns ``trainer.default_local_dir``, what a run of each
``trainer.resume_mode`` starts from, and which config keys a resume may change."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import Mapping

from verl_balance.trainer.checkpoint.layout import (
    COMPLETE_FILE,
    LATEST_FILE,
    LINEAGE_FILE,
    STEP_DIR,
    TRAINER_STATE_FILE,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointInfo,
    CheckpointUnverifiedError,
    LineageFileError,
    ResumeKeyChangedError,
    checkpoint_step,
    is_complete,
    move_aside,
    scan_checkpoints,
)
from verl_balance.trainer.checkpoint.manifest import newest_verified_checkpoint, verify_checkpoint
from verl_balance.trainer.checkpoint.resume_policy import APPLY, REFUSE, changed_keys, policy_of, resume_policies
from verl_balance.trainer.config import RESUME_MODES, ConfigError, SFTConfig
from verl_balance.utils import checksums
from verl_balance.utils.atomic_io import UnsafePathError, atomic_write_json, open_nofollow
from verl_balance.utils.tracking import METRICS_FILE, rewrite_metrics_up_to

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """Who wrote a checkpoint: this run, its lineage and the checkpoint the lineage branched from."""

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
    """The flattened config restricted to the keys with ``on_resume`` policy refuse."""
    policies = policies if policies is not None else resume_policies(SFTConfig)
    return {k: v for k, v in flatten_config(config).items() if policy_of(k, policies) == REFUSE}


def config_hash(config: dict, *, policies: Mapping[str, str] | None = None) -> str:
    """Short stable hash of ``trajectory_config(config)``."""
    blob = json.dumps(trajectory_config(config, policies=policies), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


_LINEAGE_KEYS = ("lineage_id", "run_id", "start_step")


def read_lineage(root: str) -> dict | None:
    """The directory's ``run_lineage.json`` (None when absent); LineageFileError when present but broken."""
    path = os.path.join(root, LINEAGE_FILE)
    if not os.path.lexists(path):
        return None
    fix = (
        "restore it, or set trainer.resume_mode=disable (the directory's checkpoints and this file are "
        "moved to superseded/) or trainer.resume_mode=resume_path with trainer.resume_from_path=<a checkpoint>"
    )
    try:
        with open_nofollow(path, "r") as f:  # a planted link or hard link: UnsafePathError naming it
            value = json.load(f)
    except UnsafePathError as err:
        raise LineageFileError(f"{err}; {fix}") from err
    except (OSError, ValueError) as err:
        raise LineageFileError(f"{path} cannot be read as JSON ({err}); {fix}") from err
    if not isinstance(value, dict):
        raise LineageFileError(f"{path} holds a {type(value).__name__}, not a JSON object; {fix}")
    missing = [k for k in _LINEAGE_KEYS if k not in value]
    if missing:
        raise LineageFileError(f"{path} lacks the key(s) {missing} (it has {sorted(value)}); {fix}")
    return value


def check_resume_config(lineage: dict, config: dict, *, policies: Mapping[str, str]) -> None:
    """Refuse a resume that changes a refuse-policy key (ResumeKeyChangedError naming each, old and new
    value); log applied changes. Keys absent from either side are not compared."""
    old, new = flatten_config(lineage.get("config") or {}), flatten_config(config)
    changed = [k for k in changed_keys(old, new) if k in old and k in new]
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


@dataclasses.dataclass(frozen=True)
class _RunStart:
    """What each resume mode reads: the directory scan, this run's id, the lineage record, the config check."""

    root: str
    run_id: str
    lineage: dict | None
    complete: list[CheckpointInfo]
    incomplete: list[str]
    config: dict
    policies: Mapping[str, str]
    hasher: checksums.Hasher
    resume_from_path: str | None
    allow_unverified: bool = False


# Each mode returns (checkpoint to load or None, lineage id, branch checkpoint of the lineage).
_Start = tuple[str | None, str, str | None]


def _start_auto(run: _RunStart) -> _Start:
    """``auto``: continue the recorded lineage from its newest verified checkpoint (or its branch point);
    without a record, a new lineage, refused when the directory holds checkpoints of an unknown run."""
    if run.lineage is None:
        return _start_without_lineage(run)
    lineage_id = run.lineage["lineage_id"]
    branch = run.lineage.get("branch_checkpoint")
    load_path = newest_verified_checkpoint(
        run.root, lineage_id=lineage_id, hasher=run.hasher, allow_unverified=run.allow_unverified
    )
    if load_path is None and branch is not None:
        if not (is_complete(branch) or os.path.exists(os.path.join(branch, TRAINER_STATE_FILE))):
            raise CheckpointError(
                f"lineage {lineage_id} in trainer.default_local_dir={run.root!r} started from "
                f"{branch!r}, which is no longer a complete checkpoint"
            )
        verify_checkpoint(branch, hasher=run.hasher, allow_unverified=run.allow_unverified)
        load_path = branch
    if load_path is not None:  # with nothing saved yet there is no state to contradict
        check_resume_config(run.lineage, run.config, policies=run.policies)
    return load_path, lineage_id, branch


def _start_without_lineage(run: _RunStart) -> _Start:
    """``auto`` without ``run_lineage.json``: an error when the directory holds checkpoints."""
    foreign = [c.path for c in run.complete] + [p for p in run.incomplete if STEP_DIR.match(os.path.basename(p))]
    if foreign:
        raise CheckpointError(
            f"trainer.default_local_dir={run.root!r} holds checkpoints of another run ({len(foreign)}, e.g. "
            f"{max(foreign)!r}) but no {LINEAGE_FILE} saying which run they belong to; set "
            "trainer.resume_mode=resume_path trainer.resume_from_path=<one of them> to continue it, or "
            "trainer.resume_mode=disable to start fresh (they are moved to superseded/, not deleted)"
        )
    if os.path.exists(os.path.join(run.root, METRICS_FILE)):
        moved = move_aside(run.root, [METRICS_FILE], label="no-lineage")
        logger.warning("metrics.jsonl of an unknown run moved to %s", moved)
    return None, run.run_id, None


def _start_disabled(run: _RunStart) -> _Start:
    """``disable``: a new lineage from step 0; the directory's old contents move to ``superseded/``."""
    names = [os.path.basename(c.path) for c in run.complete] + [os.path.basename(p) for p in run.incomplete]
    names += [LINEAGE_FILE, METRICS_FILE, LATEST_FILE]
    moved = move_aside(run.root, names, label=(run.lineage or {}).get("lineage_id", "unknown"))
    if moved:
        logger.warning(
            "trainer.resume_mode=disable: the previous run's checkpoints and metrics in %s were moved to %s",
            run.root,
            moved,
        )
    return None, run.run_id, None


def _start_from_path(run: _RunStart) -> _Start:
    """``resume_path``: a new lineage from the verified ``resume_from_path``; later ones move to ``superseded/``."""
    if not run.resume_from_path:
        raise ConfigError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
    load_path = os.path.abspath(run.resume_from_path)
    if not (is_complete(load_path) or os.path.exists(os.path.join(load_path, TRAINER_STATE_FILE))):
        raise CheckpointError(
            f"trainer.resume_from_path={run.resume_from_path!r} is not a complete checkpoint "
            f"(no {COMPLETE_FILE}); pick a complete global_step_N directory"
        )
    try:
        verify_checkpoint(load_path, hasher=run.hasher, allow_unverified=run.allow_unverified)
    except (CheckpointCorruptError, CheckpointUnverifiedError) as err:  # never silently use another
        raise type(err)(f"trainer.resume_from_path={run.resume_from_path!r}: {err}") from err
    start = checkpoint_step(load_path)
    later = [os.path.basename(c.path) for c in run.complete if c.step > start and c.path != load_path]
    later += [os.path.basename(p) for p in run.incomplete]
    same_dir = os.path.dirname(load_path) == os.path.abspath(run.root)
    moved = move_aside(
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
    allow_unverified: bool = False,
) -> tuple[RunIdentity, str | None]:
    """Decide this run's lineage and the checkpoint to load (None: start from the beginning).

    ``auto`` continues the directory's lineage, refusing changed keys by ``schema``'s ``on_resume``
    policies (resume_policy.py); ``disable`` starts a new lineage, moving the old one to ``superseded/``;
    ``resume_path`` branches from ``resume_from_path``. The checkpoint is verified against its manifest
    first (unverified only with ``allow_unverified``). A broken ``run_lineage.json`` is LineageFileError
    in ``auto``. Writes ``run_lineage.json`` atomically and cuts ``metrics.jsonl`` to the start step."""
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
        allow_unverified=allow_unverified,
    )
    load_path, lineage_id, branch = _MODE_STARTS[resume_mode](run)
    identity = RunIdentity(
        run_id=run.run_id,
        lineage_id=lineage_id,
        start_step=checkpoint_step(load_path) if load_path else 0,
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
    if os.path.lexists(metrics_path):  # a planted link is refused by the rewrite, naming it
        rewrite_metrics_up_to(metrics_path, identity.start_step)
