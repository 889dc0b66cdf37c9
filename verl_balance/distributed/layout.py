"""ParallelLayout: the (dp, sp) device mesh one training rank lives in.

Invariants:
- W = dp * sp ranks; global rank = dp_rank * sp + sp_rank ("sp" innermost).
- The ranks of one SP group hold the same micro-batches; the ranks of one DP group hold disjoint
  samples. FSDP2 shards parameters over the flattened ("dp", "sp") mesh of all W ranks.
- NCCL + CUDA when CUDA is available, gloo + CPU otherwise.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class LayoutError(ValueError):
    """A parallel layout that does not fit the process group or the model."""


def default_device_type() -> str:
    """ "cuda" when a GPU is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(*, backend: str | None = None, timeout_s: float = 600.0) -> None:
    """Initialize the default process group from torchrun env vars (idempotent; GPUs: cuda:LOCAL_RANK)."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


@dataclass
class ParallelLayout:
    """(dp, sp) layout of the default process group; the mesh is built lazily, on first use."""

    dp: int = 1
    sp: int = 1
    device_type: str | None = None
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key in ("dp", "sp"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"ParallelLayout.{key}={value!r}: must be a positive int")
        if self.device_type is None:
            self.device_type = default_device_type()

    @property
    def world_size(self) -> int:
        return self.dp * self.sp

    @property
    def mesh(self) -> DeviceMesh:
        """2-D DeviceMesh with axes ("dp", "sp"); requires an initialized default process group."""
        if self._mesh is None:
            if not dist.is_initialized():
                raise LayoutError(
                    "ParallelLayout.mesh: torch.distributed is not initialized "
                    "(call verl_balance.distributed.init_distributed() first)"
                )
            if dist.get_world_size() != self.world_size:
                raise LayoutError(
                    f"ParallelLayout(dp={self.dp}, sp={self.sp}) needs world size {self.world_size}, "
                    f"but the process group has {dist.get_world_size()} ranks"
                )
            self._mesh = init_device_mesh(self.device_type, (self.dp, self.sp), mesh_dim_names=("dp", "sp"))
        return self._mesh

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The ("dp", "sp") mesh flattened to one axis "dp_sp": FSDP2 shards over all W ranks."""
        return self.mesh["dp", "sp"]._flatten("dp_sp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Ranks with the same sp_rank: disjoint samples."""
        return self.mesh.get_group("dp")

    @property
    def sp_group(self) -> dist.ProcessGroup:
        """Ranks with the same dp_rank: same micro-batches, disjoint token slices."""
        return self.mesh.get_group("sp")

    @property
    def world_group(self) -> dist.ProcessGroup:
        """All W ranks of the mesh."""
        return self.fsdp_mesh.get_group()

    @property
    def rank(self) -> int:
        """Global rank = dp_rank * sp + sp_rank."""
        return self.dp_rank * self.sp + self.sp_rank

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp")

    @property
    def sp_rank(self) -> int:
        return self.mesh.get_local_rank("sp")

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)
