"""Dispatch and execute modes, the mesh routing table and the dispatch errors: the leaf of ``single_controller``.

Imports nothing from ``verl_balance``: ``decorator``, ``extensions``, ``worker``, ``worker_group``
and the integrations under ``integrations/`` all import these names from here.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Dispatch",
    "DispatchError",
    "Execute",
    "MAGIC_ATTR",
    "MeshDispatch",
    "MeshInfo",
    "MeshLayout",
    "MeshLayoutError",
    "PerRankCalls",
    "Registration",
    "UnsupportedDispatch",
    "make_mesh_dispatch",
]

MAGIC_ATTR = "__verl_balance_register__"

PerRankCalls = list[tuple[tuple, dict]]


class Dispatch(enum.Enum):
    """Predefined dispatch modes; see the module docstring. Mesh-aware: ``make_mesh_dispatch``."""

    ONE_TO_ALL = "one_to_all"
    ALL_TO_ALL = "all_to_all"
    DP_COMPUTE_PROTO = "dp_compute_proto"
    DP_COMPUTE_METRIC = "dp_compute_metric"


class Execute(enum.Enum):
    """Which ranks run the method."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


class DispatchError(ValueError):
    """The driver's arguments do not fit the method's dispatch mode."""


class MeshLayoutError(ValueError):
    """The workers' registered mesh information is missing or inconsistent."""


@dataclass(frozen=True)
class MeshDispatch:
    """Dispatch by the DP coordinates the workers registered under ``mesh_name``."""

    mesh_name: str


@dataclass(frozen=True)
class UnsupportedDispatch:
    """A foreign framework's dispatch mode with no equivalent here; calling the group method raises ``reason``."""

    reason: str


def make_mesh_dispatch(mesh_name: str) -> MeshDispatch:
    """The mesh-aware dispatch mode for ``mesh_name`` (verl: make_nd_compute_dataproto_dispatch_fn)."""
    return MeshDispatch(mesh_name)


@dataclass(frozen=True)
class MeshInfo:
    """One worker's place in a mesh: its DP group and whether its outputs are returned."""

    dp_rank: int
    dp_size: int
    is_collect: bool


@dataclass(frozen=True)
class MeshLayout:
    """Every worker's ``MeshInfo`` for one mesh name, validated: the driver's routing table."""

    mesh_name: str
    dp_size: int
    dp_rank_of_worker: tuple[int, ...]
    collect_worker_of_dp_rank: tuple[int, ...]

    @classmethod
    def from_worker_infos(cls, mesh_name: str, infos: Sequence[MeshInfo | None]) -> MeshLayout:
        """Validate the per-worker infos (index = worker rank) and build the routing table."""
        missing = [rank for rank, info in enumerate(infos) if info is None]
        if missing:
            raise MeshLayoutError(
                f"worker rank(s) {missing} did not register mesh {mesh_name!r}; call "
                f"self.register_mesh({mesh_name!r}, dp_rank=..., dp_size=..., is_collect=...) in every worker"
            )
        dp_sizes = sorted({info.dp_size for info in infos})
        if len(dp_sizes) != 1 or dp_sizes[0] < 1:
            raise MeshLayoutError(f"workers registered different or invalid dp_size for mesh {mesh_name!r}: {dp_sizes}")
        dp_size = dp_sizes[0]
        bad = {rank: info.dp_rank for rank, info in enumerate(infos) if not 0 <= info.dp_rank < dp_size}
        if bad:
            raise MeshLayoutError(f"mesh {mesh_name!r}: dp_rank outside [0, {dp_size}) for worker ranks {bad}")
        collectors: dict[int, list[int]] = {d: [] for d in range(dp_size)}
        members: dict[int, list[int]] = {d: [] for d in range(dp_size)}
        for rank, info in enumerate(infos):
            members[info.dp_rank].append(rank)
            if info.is_collect:
                collectors[info.dp_rank].append(rank)
        empty = [d for d, ranks in members.items() if not ranks]
        if empty:
            raise MeshLayoutError(f"mesh {mesh_name!r}: no worker registered dp_rank(s) {empty} of dp_size={dp_size}")
        wrong = {d: ranks for d, ranks in collectors.items() if len(ranks) != 1}
        if wrong:
            raise MeshLayoutError(
                f"mesh {mesh_name!r}: each DP group needs exactly one is_collect worker; "
                f"got {wrong} (dp_rank -> worker ranks)"
            )
        return cls(
            mesh_name=mesh_name,
            dp_size=dp_size,
            dp_rank_of_worker=tuple(info.dp_rank for info in infos),
            collect_worker_of_dp_rank=tuple(collectors[d][0] for d in range(dp_size)),
        )


@dataclass(frozen=True)
class Registration:
    """What ``register`` attached to a worker method."""

    dispatch_mode: Dispatch | MeshDispatch | UnsupportedDispatch
    execute_mode: Execute
    blocking: bool
