"""The asynchronous trainer's part of a checkpoint: the policy version and the in-flight batches.

A checkpoint of step s holds policy version s, but the batches already submitted were generated with
weights that no longer exist, so the save waits for them and writes each one's rollout output to
``in_flight_<k>.safetensors`` inside the checkpoint (covered by its manifest). A resumed run trains on
exactly those samples and so continues the uninterrupted run's curve. ``trainer_state.json`` records
``policy_version``, the in-flight list and the response-length estimate.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from verl_balance.batch_keys import (
    LOG_PROBS_KEY,
    POLICY_VERSION_KEY,
    PROMPT_INDEX_KEY,
    RESPONSE_LENGTHS_KEY,
    RESPONSE_MASK_KEY,
)
from verl_balance.rollout import RolloutOutput
from verl_balance.trainer.checkpoint import CheckpointError
from verl_balance.utils.atomic_io import refuse_symlink

POLICY_VERSION_STATE_KEY = POLICY_VERSION_KEY
IN_FLIGHT_STATE_KEY = "in_flight"
EXPECTED_RESPONSE_STATE_KEY = "rollout_expected_response_length"
# RolloutOutput fields, saved under their own names (the batch columns of the same names).
_TENSORS = (PROMPT_INDEX_KEY, "responses", RESPONSE_MASK_KEY, RESPONSE_LENGTHS_KEY, LOG_PROBS_KEY)


def in_flight_file(step: int) -> str:
    """The file name of training batch ``step``'s saved rollout output."""
    return f"in_flight_{step}.safetensors"


def save_rollout_output(path: str, output: RolloutOutput, *, version: int, predicted: dict) -> None:
    """Write ``output`` (generated with policy ``version``) to the safetensors file ``path``."""
    from safetensors.torch import save_file

    refuse_symlink(path)
    tensors = {name: torch.as_tensor(getattr(output, name)).contiguous() for name in _TENSORS[:-1]}
    if output.log_probs is not None:
        tensors[LOG_PROBS_KEY] = output.log_probs.contiguous()
    metadata = {
        "version": str(int(version)),
        "finish_reasons": json.dumps([str(r) for r in output.finish_reasons]),
        "predicted": json.dumps(predicted),
    }
    save_file(tensors, path, metadata=metadata)


def load_rollout_output(path: str) -> tuple[RolloutOutput, int, dict]:
    """The rollout output, policy version and predicted balance saved in ``path``."""
    from safetensors import safe_open

    refuse_symlink(path)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{path} is missing: this asynchronous checkpoint lists it as an in-flight batch; resume from "
            "another global_step_N directory (or with trainer.resume_mode=disable)"
        )
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    missing = [name for name in _TENSORS[:-1] if name not in tensors] + [
        key for key in ("version", "finish_reasons") if key not in metadata
    ]
    if missing:
        raise CheckpointError(f"{path} is not an in-flight batch file (missing {missing}); resume from another step")
    output = RolloutOutput(
        prompt_index=tensors[PROMPT_INDEX_KEY].numpy(),
        responses=tensors["responses"],
        response_mask=tensors[RESPONSE_MASK_KEY],
        response_lengths=tensors[RESPONSE_LENGTHS_KEY],
        finish_reasons=np.asarray(json.loads(metadata["finish_reasons"]), dtype=object),
        log_probs=tensors.get(LOG_PROBS_KEY),
    )
    return output, int(metadata["version"]), json.loads(metadata.get("predicted", "{}"))


class AsyncCheckpoint:
    """What ``trainer.checkpoint`` saves in ``separate_async``: the actor's shards plus the in-flight batches
    (one manifest over both). Loading restores the actor; the trainer reads the in-flight files itself."""

    def __init__(self, actor, write_in_flight) -> None:
        self.actor, self._write_in_flight = actor, write_in_flight

    def save_checkpoint(self, path: str, step: int, extra: dict | None = None) -> None:
        self.actor.save_checkpoint(path, step, extra)
        self._write_in_flight(path)

    def load_checkpoint(self, path: str) -> None:
        self.actor.load_checkpoint(path)

    def hash_checkpoint_files(self, path: str, sizes: dict[str, int]) -> list[dict[str, dict]]:
        return self.actor.hash_checkpoint_files(path, sizes)


__all__ = [
    "EXPECTED_RESPONSE_STATE_KEY",
    "IN_FLIGHT_STATE_KEY",
    "POLICY_VERSION_STATE_KEY",
    "AsyncCheckpoint",
    "in_flight_file",
    "load_rollout_output",
    "save_rollout_output",
]
