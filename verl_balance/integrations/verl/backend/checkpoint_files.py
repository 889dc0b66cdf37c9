"""What the verl_balance engine backend adds to a checkpoint verl's trainers save through it.

- ``checkpoint.save_contents`` with ``hf_model``: the model as a Hugging Face ``save_pretrained``
  directory ``<checkpoint>/huggingface`` (verl's FSDP engine's place for it; safetensors, config and
  the tokenizer of ``model.path``), written by ``TrainEngine.save_hf_model`` (a LoRA model merged).
- ``trainer_state.json`` with the step and the model's config; with the completeness record that
  ``sealed_checkpoint.seal`` writes last, ``python -m verl_balance.export <checkpoint> OUT``
  verifies and exports the checkpoint without flags.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from verl_balance.utils.atomic_io import atomic_write_json

__all__ = ["HF_DIR", "save_contents", "write_trainer_state"]

HF_DIR = "huggingface"
"""verl's name of the HF directory inside a checkpoint (``FSDPCheckpointManager``)."""
WRITER = "verl_balance engine backend (verl trainer)"


def save_contents(checkpoint_config) -> list[str]:
    """verl's ``checkpoint.save_contents`` (its default: model, optimizer, extra)."""
    contents = getattr(checkpoint_config, "save_contents", None) if checkpoint_config is not None else None
    if contents is None and isinstance(checkpoint_config, dict):
        contents = checkpoint_config.get("save_contents")
    return list(contents) if contents is not None else ["model", "optimizer", "extra"]


def write_trainer_state(path: str, *, step: int, model_config: dict) -> None:
    """``trainer_state.json`` (step, model config), by rank 0; the completeness record over every
    file is written after it by ``sealed_checkpoint.seal`` (collective)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        atomic_write_json(
            os.path.join(path, "trainer_state.json"),
            {"global_step": int(step), "writer": WRITER, "model_config": model_config},
        )
