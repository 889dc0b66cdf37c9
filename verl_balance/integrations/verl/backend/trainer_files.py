"""The data-loader state files verl's trainers keep beside the engine's checkpoint, checked when
the engine loads.

verl 0.9.1 saves its train loader's ``StatefulDataLoader.state_dict()`` after the engine's save
and reads it back with ``torch.load(..., weights_only=False)`` right after the engine's
``load_checkpoint`` returns, so any code pickled into that file runs in verl's trainer:

- ``main_ppo`` (legacy ``RayPPOTrainer`` and v1 ``PPOTrainer``): ``global_step_N/data.pt``, beside
  the engine's ``global_step_N/actor``;
- ``sft_trainer`` (``CheckpointHandler``): ``global_step_N/data_<dp rank>.pt``, inside the engine's
  own directory.

Invariant: the engine's ``load_checkpoint`` returns only when each of these files is a regular
file (no symlink) that ``torch.load(weights_only=True)`` reads to a dict, i.e. holds tensors and
plain Python values only; otherwise every rank raises ``TrainerFileError`` before verl unpickles it.
"""

from __future__ import annotations

import glob
import os
import pickle
import re

import torch
import torch.distributed as dist

__all__ = ["TrainerFileError", "trainer_file_paths", "trainer_files_problem", "verify_trainer_files"]


class TrainerFileError(ValueError):
    """A data-loader state file of verl's trainer that verl would unpickle unsafely, or not read."""


def trainer_file_paths(local_path: str) -> list[str]:
    """The data-loader state files verl reads after loading the engine's ``local_path`` (existing
    ones only, symlinks included)."""
    beside = os.path.join(os.path.dirname(os.path.normpath(local_path)), "data.pt")
    inside = sorted(glob.glob(os.path.join(glob.escape(local_path), "data_*.pt")))
    return [path for path in [beside, *inside] if os.path.lexists(path)]


def _fix(path: str) -> str:
    return (
        f"verl's trainer would unpickle it with weights_only=False right after this load, running any code in "
        f"it. Restore the file verl saved, or delete {path} to resume the weights and restart the data order at "
        "the epoch's start"
    )


def _unpickling_refusal(err: pickle.UnpicklingError) -> str:
    """The global torch's safe unpickler refused (``GLOBAL io.open``), else the error's first line."""
    found = re.search(r"Unsupported global: (GLOBAL \S+)", str(err))
    return f"a pickled {found.group(1)}" if found else str(err).splitlines()[0][:200]


def trainer_files_problem(local_path: str) -> str | None:
    """Why one of ``trainer_file_paths(local_path)`` may not be handed to verl (None: all safe)."""
    for path in trainer_file_paths(local_path):
        if os.path.islink(path) or not os.path.isfile(path):
            return f"{path} is a symlink or not a regular file: refused. {_fix(path)}"
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            what = _unpickling_refusal(err)
            return f"{path} holds {what}, not only a data loader's tensors and plain values: refused. {_fix(path)}"
        except Exception as err:  # truncated or not a torch file: verl's own load would fail on it too
            return f"{path} is not a readable torch file ({type(err).__name__}: {err}). {_fix(path)}"
        if not isinstance(state, dict):
            return f"{path} holds a {type(state).__name__}, not a data loader's state dict: refused. {_fix(path)}"
    return None


def verify_trainer_files(local_path: str, *, group=None) -> None:
    """Rank 0 checks the files; every rank of ``group`` raises ``TrainerFileError`` on a problem."""
    box = [trainer_files_problem(local_path) if dist.get_rank(group) == 0 else None]
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(box, group=group, group_src=0)
    if box[0] is not None:
        raise TrainerFileError(box[0])
