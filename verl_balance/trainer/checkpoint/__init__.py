"""Checkpoint bookkeeping on the driver: ``global_step_N`` directories, run lineage, retention and
the driver's own state beside the workers' sharded engine state.

Layout of ``trainer.default_local_dir``::

    .run.lock                         the live run's OS lock and its owner (run_lock.py)
    run_lineage.json                  which lineage owns the directory now
    latest_checkpointed_iteration.txt verl's marker (informational: resume never trusts it)
    global_step_N/                    complete checkpoints; checkpoint_complete.json written last
    .staging_global_step_N/           a save in progress (renamed to global_step_N when complete)
    superseded/<time>_<lineage>/      another lineage's checkpoints and metrics, moved aside
    metrics.jsonl                     this lineage's metrics, truncated to the resumed step

Guarantees: ``global_step_N`` appears only once complete; a complete checkpoint is never removed
before a newer one is complete; small state files are written atomically; ``auto`` resume picks the
newest complete checkpoint of the directory's lineage, never one of another run.
"""

from verl_balance.trainer.checkpoint.layout import (
    ALLOW_UNVERIFIED_KEY,
    COMPLETE_FILE,
    LATEST_FILE,
    LINEAGE_FILE,
    RETIRING_PREFIX,
    STAGING_PREFIX,
    SUPERSEDED_DIR,
    TRAINER_STATE_FILE,
    CheckpointCorruptError,
    CheckpointDiskFullError,
    CheckpointError,
    CheckpointInfo,
    CheckpointUnverifiedError,
    LineageFileError,
    ResumeKeyChangedError,
    checkpoint_dir,
    is_complete,
    latest_checkpoint,
    read_json,
    scan_checkpoints,
)
from verl_balance.trainer.checkpoint.lineage import (
    RunIdentity,
    check_resume_config,
    config_hash,
    flatten_config,
    read_lineage,
    start_run,
    trajectory_config,
)
from verl_balance.trainer.checkpoint.manifest import (
    group_hasher,
    newest_verified_checkpoint,
    verify_checkpoint,
    write_complete_record,
)
from verl_balance.trainer.checkpoint.save import (
    directory_size,
    load_trainer_checkpoint,
    prune_checkpoints,
    save_trainer_checkpoint,
)

__all__ = [
    "ALLOW_UNVERIFIED_KEY",
    "COMPLETE_FILE",
    "LATEST_FILE",
    "LINEAGE_FILE",
    "RETIRING_PREFIX",
    "STAGING_PREFIX",
    "SUPERSEDED_DIR",
    "TRAINER_STATE_FILE",
    "read_json",
    "CheckpointCorruptError",
    "CheckpointDiskFullError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointUnverifiedError",
    "LineageFileError",
    "ResumeKeyChangedError",
    "RunIdentity",
    "check_resume_config",
    "checkpoint_dir",
    "config_hash",
    "directory_size",
    "flatten_config",
    "group_hasher",
    "is_complete",
    "latest_checkpoint",
    "load_trainer_checkpoint",
    "newest_verified_checkpoint",
    "prune_checkpoints",
    "read_lineage",
    "save_trainer_checkpoint",
    "scan_checkpoints",
    "start_run",
    "trajectory_config",
    "verify_checkpoint",
    "write_complete_record",
]
