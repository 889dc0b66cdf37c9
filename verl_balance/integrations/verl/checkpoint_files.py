"""What the verl_balance engine backend adds to a checkpoint verl's trainers save through it.

- ``checkpoint.save_contents`` with ``hf_model``: the model as a Hugging Face ``save_pretrained``
  directory ``<checkpoint>/huggingface`` (verl's FSDP engine's place for it; safetensors, config and
  the tokenizer of ``model.path``), written by ``TrainEngine.save_hf_model`` (a LoRA model merged).
- ``trainer_state.json`` with the step and the model's config, and ``checkpoint_complete.json``
  with the size and checksum of every file then under the checkpoint, the ranks hashing their
  shares: ``python -m verl_balance.export <checkpoint> OUT`` verifies and exports it without flags.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from verl_balance.utils import checksums
from verl_balance.utils.atomic_io import atomic_write_json

__all__ = ["HF_DIR", "save_contents", "write_export_records"]

HF_DIR = "huggingface"
"""verl's name of the HF directory inside a checkpoint (``FSDPCheckpointManager``)."""
WRITER = "verl_balance engine backend (verl trainer)"


def save_contents(checkpoint_config) -> list[str]:
    """verl's ``checkpoint.save_contents`` (its default: model, optimizer, extra)."""
    contents = getattr(checkpoint_config, "save_contents", None) if checkpoint_config is not None else None
    if contents is None and isinstance(checkpoint_config, dict):
        contents = checkpoint_config.get("save_contents")
    return list(contents) if contents is not None else ["model", "optimizer", "extra"]


def _hash_across_ranks(root: str, sizes: dict[str, int]) -> dict[str, dict]:
    """Every rank hashes its share of ``sizes``; rank 0 gets the union (collective)."""
    if not dist.is_initialized():
        return checksums.hash_files(root, sizes)
    rank, world = dist.get_rank(), dist.get_world_size()
    share = [sizes]
    dist.broadcast_object_list(share, src=0)
    mine = checksums.hash_files(root, checksums.share_of(share[0], rank=rank, world=world))
    parts = [None] * world
    dist.all_gather_object(parts, mine)
    return {name: digest for part in parts for name, digest in part.items()}


def write_export_records(path: str, *, step: int, model_config: dict) -> None:
    """``trainer_state.json`` (step, model config) then ``checkpoint_complete.json`` over every file
    under ``path`` (collective: call on every rank after the checkpoint's files are written)."""
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    if is_writer:
        atomic_write_json(
            os.path.join(path, "trainer_state.json"),
            {"global_step": int(step), "writer": WRITER, "model_config": model_config},
        )
    if dist.is_initialized():
        dist.barrier()
    sizes = checksums.list_files(path) if is_writer else {}
    digests = _hash_across_ranks(path, sizes)
    if is_writer:
        atomic_write_json(
            os.path.join(path, checksums.COMPLETE_FILE),
            {"step": int(step), "writer": WRITER, "hash": checksums.HASH_NAME, checksums.MANIFEST_KEY: digests},
        )
    if dist.is_initialized():
        dist.barrier()
