"""`register` and the dispatch / collect rules that turn one driver call into per-worker calls.

A ``@register(dispatch_mode=..., execute_mode=...)`` worker method becomes a group method running
dispatch (driver args -> per-rank args) -> execute (every rank, or ``Execute.RANK_ZERO``: rank 0's
output unchanged) -> collect (rank-ordered outputs -> driver return value).

Modes (W = world size):

=====================  ============================================  =============================
mode                   dispatch                                      collect
=====================  ============================================  =============================
ONE_TO_ALL             every rank gets the same arguments            list of W outputs
ALL_TO_ALL             every argument is a list of W; rank i gets    list of W outputs
                       item i
DP_COMPUTE_PROTO       every row argument (a registered row           the container's concat in rank
                       container: ``Batch``, verl's ``DataProto``)    order (``Batch.concat``); a
                       is chunked into W (rank i gets chunk i);       list otherwise
                       other arguments are passed to every rank
DP_COMPUTE_METRIC      as DP_COMPUTE_PROTO                           list of W outputs
MeshDispatch(name)     DP chunk d to every worker with dp_rank d     outputs of the ``is_collect``
                                                                     rank of each DP group, in DP
                                                                     order, concatenated if Batches
=====================  ============================================  =============================

Mesh dispatch: each worker registers ``(name, dp_rank, dp_size, is_collect)`` after ``init``; all
SP ranks of a DP group see the same rows, and exactly one worker per DP group is collected.

Foreign modes, marks and row containers are handled by an installed ``ControllerExtension``.
This module does not import Ray.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_balance.protocol import Batch
from verl_balance.single_controller.extensions import concat_rows, read_registration, split_rows, translate_modes
from verl_balance.single_controller.modes import (
    MAGIC_ATTR,
    Dispatch,
    DispatchError,
    Execute,
    MeshDispatch,
    MeshInfo,
    MeshLayout,
    MeshLayoutError,
    PerRankCalls,
    Registration,
    UnsupportedDispatch,
    make_mesh_dispatch,
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
    "Registration",
    "UnsupportedDispatch",
    "register",
    "make_mesh_dispatch",
    "get_registration",
    "dispatch_args",
    "collect_outputs",
]


def register(
    dispatch_mode: Dispatch | MeshDispatch = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
) -> Callable:
    """Mark a worker method as callable from the driver's worker group with these modes.

    ``blocking=False`` makes the group method return a ``GroupFuture``. Foreign modes without an
    equivalent raise ``DispatchError``.
    """
    translated = translate_modes(dispatch_mode, execute_mode, method="register")
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
    """The ``Registration`` of a worker method (ours or a foreign one), or None. A foreign one
    without an equivalent has an ``UnsupportedDispatch`` mode (calling it raises ``DispatchError``).
    """
    registration = getattr(func, MAGIC_ATTR, None)
    if registration is not None:
        return registration
    return read_registration(func, method=name or getattr(func, "__name__", repr(func)))


def _chunk_or_broadcast(num_chunks: int, value: Any, *, name: str) -> list:
    chunks = split_rows(value, num_chunks, name=name)
    return [value] * num_chunks if chunks is None else chunks


def _per_dp_rank(dp_size: int, value: Any, *, name: str) -> list:
    chunks = split_rows(value, dp_size, name=name)
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


def collect_outputs(mode: Dispatch | MeshDispatch, outputs: list, *, mesh: MeshLayout | None = None) -> Any:
    """Turn the per-rank outputs (rank order) into the driver's return value (see module doc)."""
    if mode in (Dispatch.ONE_TO_ALL, Dispatch.ALL_TO_ALL, Dispatch.DP_COMPUTE_METRIC):
        return outputs
    if mode is Dispatch.DP_COMPUTE_PROTO:
        return concat_rows(outputs)
    if isinstance(mode, MeshDispatch):
        assert mesh is not None and mesh.mesh_name == mode.mesh_name
        return concat_rows([outputs[rank] for rank in mesh.collect_worker_of_dp_rank])
    raise DispatchError(f"unknown dispatch mode {mode!r}")
