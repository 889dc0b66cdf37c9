"""`Worker`: base class of every process a worker group drives (one rank of a torch job).

The group passes the rendezvous through the environment as torchrun does (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); use ``init_method="env://"``.
Without ``RANK`` a Worker is rank 0 of a world of 1. On an accelerator it binds visible device 0
(Ray's isolation), else ``LOCAL_RANK``. This module does not import Ray.
"""

from __future__ import annotations

import os
import sys

import torch

from verl_balance.single_controller.decorator import register
from verl_balance.single_controller.modes import Dispatch, MeshInfo, MeshLayoutError

__all__ = ["Worker", "NUM_THREADS_ENV", "CORE_SHARE_PREFIX", "resolve_num_threads"]

NUM_THREADS_ENV = "VERL_BALANCE_NUM_THREADS"
"""Torch thread count for the Worker: an integer, or ``cores/<k>`` (``resolve_num_threads``)."""

CORE_SHARE_PREFIX = "cores/"


def resolve_num_threads(value: str, *, cores: int | None = None) -> int:
    """Torch threads for a ``NUM_THREADS_ENV`` value: ``"n"`` is n (at least 1); ``"cores/<k>"`` is
    this process's usable cores (``cores``, default its CPU affinity) // k, at least 1."""
    if value.startswith(CORE_SHARE_PREFIX):
        share = int(value.removeprefix(CORE_SHARE_PREFIX))
        assert share >= 1, f"{NUM_THREADS_ENV}={value}: the worker group sets k >= 1"
        if cores is None:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, cores // share)
    return max(1, int(value))


class Worker:
    """One rank of a worker group: rendezvous info from the environment plus mesh registration."""

    def __init__(self) -> None:
        self._rank = int(os.environ.get("RANK", "0"))
        self._world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self._master_addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._master_port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None
        self._mesh_infos: dict[str, MeshInfo] = {}
        if NUM_THREADS_ENV in os.environ:
            # workers share the node's cores: one intra-op pool per reserved CPU or per core share
            threads = resolve_num_threads(os.environ[NUM_THREADS_ENV])
            torch.set_num_threads(threads)
            os.environ["OMP_NUM_THREADS"] = str(threads)  # for processes this worker starts
        if torch.accelerator.is_available():
            count = torch.accelerator.device_count()
            torch.accelerator.set_device_index(0 if count == 1 else self._local_rank % count)

    def __repr__(self) -> str:
        """``ActorWorker rank=3``: Ray prefixes this worker's forwarded console lines with it."""
        return f"{type(self).__name__} rank={self._rank}"

    @property
    def rank(self) -> int:
        """Global rank of this worker in its group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Number of workers in the group."""
        return self._world_size

    @property
    def local_rank(self) -> int:
        """Index of this worker among the group's workers on its node."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """Number of the group's workers on this worker's node."""
        return self._local_world_size

    @property
    def master_addr(self) -> str:
        """Address of rank 0's node (torch.distributed rendezvous)."""
        return self._master_addr

    @property
    def master_port(self) -> int | None:
        """Free port on rank 0's node chosen by the group (None outside a group)."""
        return self._master_port

    @property
    def device(self) -> torch.device:
        """The accelerator this worker computes on, or the CPU."""
        if torch.accelerator.is_available():
            accelerator = torch.accelerator.current_accelerator()
            return torch.device(accelerator.type, torch.accelerator.current_device_index())
        return torch.device("cpu")

    def register_mesh(self, mesh_name: str, *, dp_rank: int, dp_size: int, is_collect: bool) -> None:
        """Declare this worker's DP coordinates for ``make_mesh_dispatch(mesh_name)`` methods; once
        per mesh, ``is_collect`` on exactly one worker per DP group.
        """
        if mesh_name in self._mesh_infos:
            raise MeshLayoutError(f"worker rank {self._rank} already registered mesh {mesh_name!r}")
        self._mesh_infos[mesh_name] = MeshInfo(dp_rank=int(dp_rank), dp_size=int(dp_size), is_collect=bool(is_collect))

    def mesh_info(self, mesh_name: str) -> MeshInfo | None:
        """This worker's registered info for ``mesh_name``, or None."""
        return self._mesh_infos.get(mesh_name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def _query_mesh_info(self, mesh_name: str) -> MeshInfo | None:
        return self.mesh_info(mesh_name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_rank_info(self) -> dict:
        """Rank, world size, node address and device of this worker (for logs and checks)."""
        return {
            "rank": self._rank,
            "world_size": self._world_size,
            "local_rank": self._local_rank,
            "master_addr": self._master_addr,
            "master_port": self._master_port,
            "pid": os.getpid(),
            "device": str(self.device),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "num_threads": torch.get_num_threads(),
            "node_id": _ray_node_id(),
        }


def _ray_node_id() -> str | None:
    """The Ray node this process runs on, or None outside Ray (this module does not import Ray)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()
