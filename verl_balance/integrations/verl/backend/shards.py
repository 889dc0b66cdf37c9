"""Per-tensor local shards for verl's sharded weight export (``BaseEngine.get_per_tensor_param_shard``,
verl 0.9.1 and main): each rank yields ``(name, flat local shard, spec)`` for the delta checkpoint
engines, which diff and gather each rank's shard without materialising full tensors.

The spec is verl's ``ShardSpec`` (``verl.workers.engine.spec``) where the installed verl has it,
else ``LocalShardSpec`` with the same placement fields (a verl without its delta weight sync).
Feature-detected, never pinned: one backend serves both verls."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor


@dataclass
class LocalShardSpec:
    """Placement of one exported shard: the full tensor's shape, and for a DTensor its mesh and
    placements (None: the tensor is not sharded). The fields of verl main's ``ShardSpec``."""

    full_shape: tuple
    mesh: Any = None
    placements: tuple | None = None


def shard_spec_class() -> type:
    """verl's ``ShardSpec`` when the installed verl defines it, else ``LocalShardSpec``."""
    try:
        from verl.workers.engine.spec import ShardSpec
    except ImportError:
        return LocalShardSpec
    return ShardSpec


def spec_of(param: torch.Tensor, spec_class: type) -> Any:
    """The spec of ``param`` (as verl's ``ShardSpec.from_param``)."""
    if isinstance(param, DTensor):
        return spec_class(full_shape=tuple(param.shape), mesh=param.device_mesh, placements=tuple(param.placements))
    return spec_class(full_shape=tuple(param.shape))


def local_param_shards(
    module: torch.nn.Module, *, device: torch.device | str
) -> Iterator[tuple[str, torch.Tensor, Any]]:
    """``(name, this rank's local shard flattened, spec)`` for every entry of ``module.state_dict()``,
    in its order (identical on every rank); floating tensors in bf16, as verl's FSDP engine exports
    them. Not collective: nothing is gathered."""
    spec_class = shard_spec_class()
    for name, param in module.state_dict().items():
        spec = spec_of(param, spec_class)
        local = param.to_local() if isinstance(param, DTensor) else param
        local = local.detach().to(device, non_blocking=True)
        if local.is_floating_point():
            local = local.to(torch.bfloat16)
        yield name, local.reshape(-1), spec
