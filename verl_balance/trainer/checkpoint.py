"""Checkpoint bookkeeping on the driver: ``global_step_N`` directories, the latest-step marker
and the driver's own state beside the workers' sharded engine state."""

from __future__ import annotations

import json
import os
import shutil

from verl_balance.single_controller import RayWorkerGroup
from verl_balance.trainer.config import ConfigError
from verl_balance.utils.tracking import read_metrics

LATEST_FILE = "latest_checkpointed_iteration.txt"
TRAINER_STATE_FILE = "trainer_state.json"


def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def latest_checkpoint(root: str) -> str | None:
    """The directory named by ``latest_checkpointed_iteration.txt`` under root, if complete."""
    marker = os.path.join(root, LATEST_FILE)
    if not os.path.exists(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        step = int(f.read().strip())
    path = checkpoint_dir(root, step)
    return path if os.path.exists(os.path.join(path, TRAINER_STATE_FILE)) else None


def save_trainer_checkpoint(group: RayWorkerGroup, *, root: str, step: int, trainer_state: dict) -> str:
    """Workers write the sharded engine state; the driver writes its own state, then the marker.

    The marker is written last, so a stop mid-save leaves the previous checkpoint as latest.
    """
    path = checkpoint_dir(root, step)
    if os.path.exists(path):
        shutil.rmtree(path)
    group.save_checkpoint(path, step)
    with open(os.path.join(path, TRAINER_STATE_FILE), "w", encoding="utf-8") as f:
        json.dump(trainer_state, f)
    with open(os.path.join(root, LATEST_FILE), "w", encoding="utf-8") as f:
        f.write(str(step))
    return path


def load_trainer_checkpoint(group: RayWorkerGroup, path: str) -> dict:
    """Restore workers from ``path`` and return the driver's saved state."""
    if not os.path.exists(os.path.join(path, TRAINER_STATE_FILE)):
        raise ConfigError(f"trainer.resume_from_path={path!r} is not a complete checkpoint "
                          f"(no {TRAINER_STATE_FILE}); pick a global_step_N directory")
    group.load_checkpoint(path)
    with open(os.path.join(path, TRAINER_STATE_FILE), encoding="utf-8") as f:
        return json.load(f)


def truncate_metrics_after(path: str, step: int) -> None:
    """Drop records past ``step`` so a resumed run's metrics file reads as one uninterrupted curve."""
    if not os.path.exists(path):
        return
    keep = [r for r in read_metrics(path) if int(r.get("step", 0)) <= step]
    with open(path, "w", encoding="utf-8") as f:
        for record in keep:
            f.write(json.dumps(record) + "\n")
