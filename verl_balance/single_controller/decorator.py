"""`register` and the dispatch / collect rules that turn one driver call into per-worker calls.

A worker method decorated with ``@register(dispatch_mode=..., execute_mode=...)`` becomes a method
of the driver-side worker group that runs ``dispatch -> execute -> collect``:

- dispatch turns the driver's ``(args, kwargs)`` into one ``(args, kwargs)`` per worker rank;
- execute calls the method on every worker (``Execute.ALL``) or on rank 0 only
  (``Execute.RANK_ZERO``, which returns rank 0's output unchanged and skips collect);
- collect turns the list of per-rank outputs (rank order) into the driver's return value.

Modes (W = world size):

=====================  ============================================  =============================
mode                   dispatch                                      collect
=====================  ============================================  =============================
ONE_TO_ALL             every rank gets the same arguments            list of W outputs
ALL_TO_ALL             every argument is a list of W; rank i gets    list of W outputs
                       item i
DP_COMPUTE_PROTO       every row argument (``Batch``, verl           ``Batch.concat`` in rank order
                       ``DataProto``, ``TensorDict``) is chunked      (verl's concat for DataProto /
                       into W (rank i gets chunk i); other            TensorDict; a list otherwise)
                       arguments are passed to every rank
DP_COMPUTE_METRIC      as DP_COMPUTE_PROTO                           list of W outputs
MeshDispatch(name)     DP-mesh aware, see below                      outputs of the ``is_collect``
                                                                     rank of each DP group, in DP
                                                                     order, concatenated if Batches
=====================  ============================================  =============================

Mesh dispatch. After ``init``, each worker calls ``self.register_mesh(name, dp_rank=...,
dp_size=..., is_collect=...)`` (a verl worker: ``self._register_dispatch_collect_info(name,
dp_rank=..., is_collect=...)``); the group reads that table once per mesh name. A row
argument is chunked into ``dp_size`` pieces, or the driver passes a list of ``dp_size`` Batches
(e.g. from ``split_by_plan``); DP chunk d goes to every worker whose ``dp_rank == d`` (all SP
ranks of the DP group see the same rows, as sequence parallelism requires); non-Batch arguments go
to every worker. Exactly one worker per DP group has ``is_collect`` (SP rank 0), and only those
outputs are returned, so replicated SP outputs are not counted twice.

verl's ``Dispatch`` / ``Execute`` members and ``make_nd_compute_dataproto_dispatch_fn`` are
accepted by ``register`` and by the worker group where we have the same mode (see
``verl_compat``); verl itself is never imported here.

This module does not import Ray.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from verl_balance.protocol import Batch
from verl_balance.single_controller.verl_compat import (
    UnsupportedDispatch,
    chunk_verl_rows,
    concat_verl_rows,
    translate_verl_modes,
)

__all__ = [
    "Dispatch",
    "Execute",
    "MeshDispatch",
    "MeshInfo",
    "MeshLayout",
    "MeshLayoutError",
    "DispatchError",
    "MAGIC_ATTR",
    "register",
    "make_mesh_dispatch",
    "get_registration",
    "dispatch_args",
    "collect_outputs",
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


def register(
    dispatch_mode: Dispatch | MeshDispatch = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
) -> Callable:
    """Mark a worker method as callable from the driver's worker group with these modes.

    ``blocking=False`` makes the group method return a ``GroupFuture`` (call ``.get()``).
    The method itself is unchanged and still callable directly on the worker. verl's
    ``Dispatch``/``Execute`` members and ``make_nd_compute_dataproto_dispatch_fn(name)`` are
    translated to ours; verl modes without an equivalent raise ``DispatchError`` here.
    """
    translated = translate_verl_modes(dispatch_mode, execute_mode, method="register")
    if translated is not None:
        dispatch_mode, execute_mode = translated
        if isinstance(dispatch_mode, UnsupportedDispatch):
            raise DispatchError(dispatch_mode.reason)
    if not isinstance(dispatch_mode, (Dispatch, MeshDispatch)):
        raise DispatchError(
            f"dispatch_mode must be a Dispatch member or make_mesh_dispatch(name), got {dispatch_mode!r}"
        )
    if not isinstance(execute_mode, Execute):
        raise DispatchError(f"execute_mode must be an Execute member, got {execute_mode!r}")

    def decorator(func: Callable) -> Callable:
        setattr(func, MAGIC_ATTR, Registration(dispatch_mode, execute_mode, bool(blocking)))
        return func

    return decorator


def get_registration(func: Any, *, name: str | None = None) -> Registration | None:
    """The ``Registration`` of a worker method (ours, or verl's translated), or None if not registered.

    A verl registration without an equivalent here comes back with an ``UnsupportedDispatch``
    mode: the group binds it to a method that raises ``DispatchError`` with the reason.
    """
    registration = getattr(func, MAGIC_ATTR, None)
    if registration is not None:
        return registration
    from verl_balance.single_controller.verl_compat import verl_registration_modes

    modes = verl_registration_modes(func, method=name or getattr(func, "__name__", repr(func)))
    if modes is None:
        return None
    dispatch_mode, execute_mode, blocking = modes
    if not isinstance(execute_mode, Execute):
        execute_mode = Execute.ALL
    return Registration(dispatch_mode, execute_mode, blocking)


def _row_chunks(num_chunks: int, value: Any, *, name: str) -> list | None:
    """``num_chunks`` row chunks of a Batch / verl DataProto / TensorDict, None for other values."""
    if isinstance(value, Batch):
        return value.chunk(num_chunks)
    return chunk_verl_rows(value, num_chunks, name=name)


def _chunk_or_broadcast(num_chunks: int, value: Any, *, name: str) -> list:
    chunks = _row_chunks(num_chunks, value, name=name)
    return [value] * num_chunks if chunks is None else chunks


def _per_dp_rank(dp_size: int, value: Any, *, name: str) -> list:
    chunks = _row_chunks(dp_size, value, name=name)
    if chunks is not None:
        return chunks
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Batch) for v in value):
        if len(value) != dp_size:
            raise DispatchError(f"argument {name} is a list of {len(value)} Batches; the mesh has dp_size={dp_size}")
        return list(value)
    return [value] * dp_size


def _transpose(world_size: int, per_rank_args: list[list], per_rank_kwargs: dict[str, list]) -> PerRankCalls:
    return [
        (tuple(a[i] for a in per_rank_args), {k: v[i] for k, v in per_rank_kwargs.items()}) for i in range(world_size)
    ]


def dispatch_args(
    mode: Dispatch | MeshDispatch,
    args: tuple,
    kwargs: dict,
    *,
    world_size: int,
    mesh: MeshLayout | None = None,
) -> PerRankCalls:
    """Split the driver's call into ``world_size`` per-rank ``(args, kwargs)`` (see module doc)."""
    names = [f"#{i}" for i in range(len(args))]
    if mode is Dispatch.ONE_TO_ALL:
        return [(tuple(args), dict(kwargs)) for _ in range(world_size)]
    if mode is Dispatch.ALL_TO_ALL:
        for name, value in [*zip(names, args), *kwargs.items()]:
            if not isinstance(value, (list, tuple)) or len(value) != world_size:
                got = (
                    f"a {type(value).__name__} of length {len(value)}"
                    if isinstance(value, (list, tuple))
                    else type(value).__name__
                )
                raise DispatchError(
                    f"ALL_TO_ALL argument {name} must be a list of {world_size} (one per worker), got {got}"
                )
        return _transpose(world_size, [list(a) for a in args], {k: list(v) for k, v in kwargs.items()})
    if mode in (Dispatch.DP_COMPUTE_PROTO, Dispatch.DP_COMPUTE_METRIC):
        per_args = [_chunk_or_broadcast(world_size, a, name=n) for n, a in zip(names, args)]
        per_kwargs = {k: _chunk_or_broadcast(world_size, v, name=k) for k, v in kwargs.items()}
        return _transpose(world_size, per_args, per_kwargs)
    if isinstance(mode, MeshDispatch):
        assert mesh is not None and mesh.mesh_name == mode.mesh_name and len(mesh.dp_rank_of_worker) == world_size
        per_dp_args = [_per_dp_rank(mesh.dp_size, a, name=n) for n, a in zip(names, args)]
        per_dp_kwargs = {k: _per_dp_rank(mesh.dp_size, v, name=k) for k, v in kwargs.items()}
        # every SP rank of DP group d receives the same object: chunk d
        per_args = [[chunks[d] for d in mesh.dp_rank_of_worker] for chunks in per_dp_args]
        per_kwargs = {k: [chunks[d] for d in mesh.dp_rank_of_worker] for k, chunks in per_dp_kwargs.items()}
        return _transpose(world_size, per_args, per_kwargs)
    if isinstance(mode, UnsupportedDispatch):
        raise DispatchError(mode.reason)
    raise DispatchError(f"unknown dispatch mode {mode!r}")


def _concat_if_batches(outputs: list) -> Any:
    if outputs and all(isinstance(o, Batch) for o in outputs):
        return Batch.concat(outputs)
    concatenated = concat_verl_rows(outputs)
    return outputs if concatenated is None else concatenated


def collect_outputs(mode: Dispatch | MeshDispatch, outputs: list, *, mesh: MeshLayout | None = None) -> Any:
    """Turn the per-rank outputs (rank order) into the driver's return value (see module doc)."""
    if mode in (Dispatch.ONE_TO_ALL, Dispatch.ALL_TO_ALL, Dispatch.DP_COMPUTE_METRIC):
        return outputs
    if mode is Dispatch.DP_COMPUTE_PROTO:
        return _concat_if_batches(outputs)
    if isinstance(mode, MeshDispatch):
        assert mesh is not None and mesh.mesh_name == mode.mesh_name
        return _concat_if_batches([outputs[rank] for rank in mesh.collect_worker_of_dp_rank])
    raise DispatchError(f"unknown dispatch mode {mode!r}")
