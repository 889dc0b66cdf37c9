"""Hugging Face safetensors directories, read and written one tensor slice at a time.

Writing (``ShardedSafetensorsWriter``) holds at most one file's tensors (+ the one added); the file
plan is fixed from (name, shape, dtype) before any tensor arrives.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verl_balance.models.config import ModelConfigError

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def safetensors_key_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file of the HF directory ``path`` (single file or indexed)."""
    index = os.path.join(path, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SAFE_WEIGHTS_NAME)
    if not os.path.isfile(single):
        raise ModelConfigError(
            f"model.path={path!r} has no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}: "
            "init=pretrained needs safetensors weights (or set model.init=random)"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}


def checkpoint_key(name: str, files: dict[str, str]) -> str | None:
    """The checkpoint's key for ``name`` (base-model prefix may be absent; Mixtral's ``block_sparse_moe``)."""
    for candidate in _name_variants(name):
        if candidate in files:
            return candidate
    return None


def _name_variants(name: str) -> list[str]:
    names = [name]
    if ".mlp." in name:
        names.append(name.replace(".mlp.", ".block_sparse_moe.", 1))
    return names + [n[len("model.") :] for n in names if n.startswith("model.")]


# transformers 5 fuses the experts of an MoE layer into one parameter per projection
# ([E, 2I, H] gate_up_proj, [E, H, I] down_proj); checkpoints keep one tensor per expert and
# projection. Per fused suffix: the per-expert projection names (concatenated along dim 0 in this
# order), for the Qwen/DeepSeek and the Mixtral naming (transformers' conversion_mapping.py).
_FUSED_EXPERT_SOURCES = {
    "experts.gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "experts.down_proj": (("down_proj",), ("w2",)),
}


def expert_sources(name: str, files: dict[str, str]) -> list[list[str]] | None:
    """Per expert, the checkpoint keys whose dim-0 concatenation gives fused MoE parameter ``name``; or None."""
    for suffix, namings in _FUSED_EXPERT_SOURCES.items():
        if not name.endswith(suffix):
            continue
        prefix = name[: -len(suffix)]  # ends with "."
        for projections in namings:
            for base in _name_variants(prefix + "experts.0." + projections[0] + ".weight"):
                experts_prefix = base[: base.index("experts.0.")] + "experts."
                sources = []
                while all(f"{experts_prefix}{len(sources)}.{p}.weight" in files for p in projections):
                    sources.append([f"{experts_prefix}{len(sources)}.{p}.weight" for p in projections])
                if sources:
                    return sources
    return None


@dataclass(frozen=True)
class TensorSpec:
    """What will be written under ``name``: its shape and dtype (the file plan needs no data)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=self.dtype).element_size()


def plan_files(specs: Sequence[TensorSpec], *, max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of ``specs`` of at most ``max_shard_bytes`` each (a larger tensor alone)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0")
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if groups[-1] and size + spec.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += spec.nbytes
    return groups


class ShardedSafetensorsWriter:
    """Write tensors, in ``specs`` order, as HF safetensors files of bounded size (see module doc)."""

    def __init__(self, out: str, specs: Sequence[TensorSpec], *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in the write plan")
        self.out = out
        self.groups = plan_files(specs, max_shard_bytes=max_shard_bytes)
        n = len(self.groups)
        self.file_names = (
            [SAFE_WEIGHTS_NAME] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        )
        self._group, self._pending = 0, {}
        self._expected = iter(specs)
        os.makedirs(out, exist_ok=True)

    def add(self, name: str, tensor: Tensor) -> None:
        """The next tensor of the plan (same name, shape, dtype); writes a file once it is complete."""
        spec = next(self._expected, None)
        if spec is None or spec.name != name:
            raise ValueError(f"tensor {name!r} arrived out of plan order (expected {spec and spec.name!r})")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype}, planned {spec.shape} {spec.dtype}")
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        if len(self._pending) == len(self.groups[self._group]):
            from safetensors.torch import save_file

            save_file(self._pending, os.path.join(self.out, self.file_names[self._group]), metadata={"format": "pt"})
            self._group, self._pending = self._group + 1, {}

    def close(self) -> list[str]:
        """Check every planned tensor was written and write the index; returns the file names."""
        if self._group != len(self.groups):
            raise ValueError(f"only {self._group} of {len(self.groups)} safetensors files were complete")
        if len(self.groups) > 1:
            index = {
                "metadata": {"total_size": sum(s.nbytes for g in self.groups for s in g)},
                "weight_map": {s.name: self.file_names[k] for k, g in enumerate(self.groups) for s in g},
            }
            with open(os.path.join(self.out, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
                json.dump(index, f, indent=2, sort_keys=True)
        return list(self.file_names)


def write_tensors(
    out: str,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, Tensor]],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write (name, tensor) pairs, in ``specs`` order, as bounded safetensors files under ``out``."""
    writer = ShardedSafetensorsWriter(out, specs, max_shard_bytes=max_shard_bytes)
    for name, tensor in tensors:
        writer.add(name, tensor)
    return writer.close()


def share_files(directory: str) -> None:
    """Give the regular files under ``directory`` the mode a plain ``open`` gives (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                os.chmod(path, 0o666 & ~umask)


def save_hf_directory(
    out: str,
    *,
    hf_config,
    specs: Sequence[TensorSpec],
    tensors: Iterable[tuple[str, Tensor]],
    tokenizer_path: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """A save_pretrained-style directory: config.json, bounded safetensors files, generation_config.json,
    the tokenizer if any; files readable as save_pretrained's."""
    from transformers import GenerationConfig

    os.makedirs(out, exist_ok=True)
    write_tensors(out, specs, tensors, max_shard_bytes=max_shard_bytes)
    dtypes = {s.dtype for s in specs}
    if len(dtypes) == 1:
        hf_config.dtype = dtypes.pop()
    hf_config.save_pretrained(out)
    if tokenizer_path and os.path.exists(os.path.join(tokenizer_path, "generation_config.json")):
        generation = GenerationConfig.from_pretrained(tokenizer_path, local_files_only=True)
    else:
        generation = GenerationConfig.from_model_config(hf_config)
    generation.save_pretrained(out)
    if tokenizer_path and os.path.exists(os.path.join(tokenizer_path, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True).save_pretrained(out)
    else:
        logger.warning("no tokenizer found at %r; %s has weights and config only", tokenizer_path, out)
    share_files(out)
    return out
