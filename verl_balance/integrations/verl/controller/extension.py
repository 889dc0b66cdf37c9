"""verl on our single controller: verl's ``register`` marks, ``Dispatch`` members, ``Worker`` classes
and row containers, as a ``ControllerExtension`` plus row-container registrations.

``install()`` registers them; importing ``verl_balance.integrations.verl`` calls it. Nothing here
imports verl: a verl object can only exist if its module is already in ``sys.modules``.

Translation of verl's dispatch modes (verl 0.9.1) to ours:

==============================  ===============================================================
verl                            ours
==============================  ===============================================================
ONE_TO_ALL                      ONE_TO_ALL
ALL_TO_ALL                      ALL_TO_ALL (arguments must be lists of W; verl silently
                                broadcasts anything else, we raise ``DispatchError``)
DP_COMPUTE                      ALL_TO_ALL (verl: every argument a list of W, outputs a list)
DP_COMPUTE_PROTO                DP_COMPUTE_PROTO (incl. verl's auto-padding, see below)
DP_COMPUTE_PROTO_WITH_FUNC      DP_COMPUTE_PROTO (the leading function is broadcast)
DP_COMPUTE_METRIC               DP_COMPUTE_METRIC
make_nd_compute_dataproto_      ``make_mesh_dispatch(mesh_name)``; a verl worker's
dispatch_fn(mesh_name)          ``_register_dispatch_collect_info`` supplies the mesh table
ALL_TO_ALL + Execute.RANK_ZERO  rank 0 gets the call's arguments unchanged (as in verl)
anything else                   a group method that raises ``DispatchError`` saying why
==============================  ===============================================================

Row containers (``DataProto``, ``DataProtoFuture``, ``TensorDict``) are split by verl's ``chunk``;
uneven lengths are a ``DispatchError``, except an auto-padding ``DataProto`` under
DP_COMPUTE_PROTO / DP_COMPUTE_METRIC: padded with copies of its last row, the padding dropped from
the output. The caller's DataProto is not modified.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from tensordict import TensorDict

from verl_balance.integrations.verl.compat import verl_registration
from verl_balance.single_controller.extensions import (
    ControllerExtension,
    RowContainer,
    register_extension,
    register_row_container,
)
from verl_balance.single_controller.modes import (
    Dispatch,
    DispatchError,
    Execute,
    MeshDispatch,
    MeshInfo,
    Registration,
    UnsupportedDispatch,
)

__all__ = [
    "VerlControllerExtension",
    "drop_padding",
    "install",
    "is_verl_worker_class",
    "pad_for_even_chunks",
    "translate_verl_modes",
    "verl_registration_modes",
]

_VERL_DECORATOR = "verl.single_controller.base.decorator"
_VERL_WORKER = "verl.single_controller.base.worker"
_VERL_PROTOCOL = "verl.protocol"
_ND_DISPATCH_FN = "dispatch_lazy_compute_data_proto"


def _module(name: str):
    return sys.modules.get(name)


def is_verl_worker_class(cls: Any) -> bool:
    """Whether ``cls`` subclasses verl's ``Worker`` (False when verl was never imported)."""
    module = _module(_VERL_WORKER)
    return module is not None and isinstance(cls, type) and issubclass(cls, module.Worker)


def _is_verl_member(value: Any, enum_name: str) -> bool:
    module = _module(_VERL_DECORATOR)
    return module is not None and isinstance(value, getattr(module, enum_name))


def _nd_mesh_name(mode: Any) -> str | None:
    """The mesh name of a ``make_nd_compute_dataproto_dispatch_fn(mesh_name)`` dict, else None."""
    if not isinstance(mode, dict):
        return None
    fn = mode.get("dispatch_fn")
    if (
        isinstance(fn, functools.partial)
        and getattr(fn.func, "__name__", "") == _ND_DISPATCH_FN
        and getattr(fn.func, "__module__", "") == _VERL_DECORATOR
        and len(fn.args) == 1
    ):
        return fn.args[0]
    return None


def translate_verl_modes(dispatch_mode: Any, execute_mode: Any, *, method: str) -> tuple[Any, Any] | None:
    """Our (dispatch, execute) modes for verl's, an ``UnsupportedDispatch``, or None if not verl's."""
    dispatch_is_verl = _is_verl_member(dispatch_mode, "Dispatch") or isinstance(dispatch_mode, dict)
    execute_is_verl = _is_verl_member(execute_mode, "Execute")
    if not dispatch_is_verl and not execute_is_verl:
        return None
    execute = execute_mode
    if execute_is_verl and execute_mode.name in Execute.__members__:
        execute = Execute[execute_mode.name]
    if not isinstance(execute, Execute):
        reason = f"{method}: execute_mode {execute_mode!r} has no equivalent here (ALL, RANK_ZERO)"
        return UnsupportedDispatch(reason), execute_mode
    if not dispatch_is_verl:
        return dispatch_mode, execute
    mesh_name = _nd_mesh_name(dispatch_mode)
    if mesh_name is not None:
        mode = MeshDispatch(mesh_name)
    elif isinstance(dispatch_mode, dict):
        return UnsupportedDispatch(
            f"{method} is registered with a custom verl dispatch_fn/collect_fn ({dispatch_mode.get('dispatch_fn')!r}); "
            "only verl's predefined modes and make_nd_compute_dataproto_dispatch_fn run on this controller"
        ), execute
    else:
        mode = {
            "ONE_TO_ALL": Dispatch.ONE_TO_ALL,
            "ALL_TO_ALL": Dispatch.ALL_TO_ALL,
            "DP_COMPUTE": Dispatch.ALL_TO_ALL,
            "DP_COMPUTE_PROTO": Dispatch.DP_COMPUTE_PROTO,
            "DP_COMPUTE_PROTO_WITH_FUNC": Dispatch.DP_COMPUTE_PROTO,
            "DP_COMPUTE_METRIC": Dispatch.DP_COMPUTE_METRIC,
        }.get(dispatch_mode.name)
        if mode is None:
            return UnsupportedDispatch(
                f"{method} is registered with verl's Dispatch.{dispatch_mode.name}, which has no equivalent here "
                "(supported: ONE_TO_ALL, ALL_TO_ALL, DP_COMPUTE, DP_COMPUTE_PROTO, DP_COMPUTE_PROTO_WITH_FUNC, "
                "DP_COMPUTE_METRIC, make_nd_compute_dataproto_dispatch_fn)"
            ), execute
    if execute is Execute.RANK_ZERO:
        # verl hands rank 0 whatever dispatch produced: for ALL_TO_ALL, the call's own arguments
        if not isinstance(dispatch_mode, dict) and dispatch_mode.name == "ALL_TO_ALL":
            return Dispatch.ONE_TO_ALL, execute
        return UnsupportedDispatch(
            f"{method} combines Execute.RANK_ZERO with {dispatch_mode!r}: verl would pass rank 0 the per-rank "
            "argument lists; register it with dispatch_mode=Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO"
        ), execute
    return mode, execute


def verl_registration_modes(func: Any, *, method: str) -> tuple[Any, Any, bool] | None:
    """(dispatch, execute, blocking) in our terms for a method marked by verl's ``register``, else None."""
    attrs = verl_registration(func)
    if not isinstance(attrs, dict) or "dispatch_mode" not in attrs:
        return None
    modes = translate_verl_modes(attrs["dispatch_mode"], attrs.get("execute_mode"), method=method)
    if modes is None:  # marked by verl's register with modes verl would reject: be explicit anyway
        modes = UnsupportedDispatch(f"{method}: unrecognised verl registration {attrs!r}"), attrs.get("execute_mode")
    return modes[0], modes[1], bool(attrs.get("blocking", True))


_EVEN_CHUNKS = " (verl's chunk requires equal pieces)"


def _verl_concat(outputs: list) -> Any:
    """verl's concatenation of per-rank DataProtos / TensorDicts of one exact type (a list otherwise)."""
    protocol = _module(_VERL_PROTOCOL)
    if protocol is None or any(type(o) is not type(outputs[0]) for o in outputs):
        return outputs
    return protocol.BatchData(list(outputs)).concat()


def _split_tensordict(value: TensorDict, num_chunks: int) -> list:
    return list(_module(_VERL_PROTOCOL).BatchData(value).chunk(chunks=num_chunks))


_DATAPROTO_ROWS = RowContainer(
    split=lambda data, n: data.chunk(n),
    concat=_verl_concat,
    length=len,
    even_only=True,
    uneven_hint=_EVEN_CHUNKS + ", or enable auto-padding (meta_info['_verl_auto_padding']=True) under DP_COMPUTE_PROTO",
)
_DATAPROTO_FUTURE_ROWS = RowContainer(split=lambda future, n: future.chunk(n), concat=None, length=lambda f: None)


def _tensordict_refusal(value: TensorDict) -> str | None:
    if _module(_VERL_PROTOCOL) is not None:
        return None
    return (
        "bare TensorDict: wrap it in verl_balance.protocol.Batch to split it over the workers "
        "(or import verl, whose chunk_tensordict splits it)"
    )


_TENSORDICT_ROWS = RowContainer(
    split=_split_tensordict,
    concat=_verl_concat,
    length=lambda td: td.batch_size[0],
    even_only=True,
    uneven_hint=_EVEN_CHUNKS,
    refusal=_tensordict_refusal,
)


def pad_for_even_chunks(args: tuple, kwargs: dict, num_chunks: int) -> tuple[tuple, dict, int]:
    """verl's auto-padding: (new args, kwargs, padding rows) padded to a multiple of ``num_chunks``;
    the inputs are not modified.
    """
    protocol = _module(_VERL_PROTOCOL)
    if protocol is None:
        return args, kwargs, 0
    lengths = {
        len(v) for v in (*args, *kwargs.values()) if isinstance(v, protocol.DataProto) and v.is_padding_enabled()
    }
    if not lengths:
        return args, kwargs, 0
    if len(lengths) > 1:
        raise DispatchError(f"auto-padded DataProto arguments must have the same length, got {sorted(lengths)}")
    length = lengths.pop()
    padding = -length % num_chunks
    if padding == 0 or length == 0:
        return args, kwargs, 0

    def pad(value: Any) -> Any:
        if not (isinstance(value, protocol.DataProto) and value.is_padding_enabled()):
            return value
        return protocol.DataProto.concat([value, value.select_idxs([length - 1]).repeat(padding)])

    return tuple(pad(a) for a in args), {k: pad(v) for k, v in kwargs.items()}, padding


def drop_padding(output: Any, padding: int) -> Any:
    """Remove the last ``padding`` rows that ``pad_for_even_chunks`` added from a DataProto output."""
    if padding == 0:
        return output
    protocol = _module(_VERL_PROTOCOL)
    if protocol is not None and isinstance(output, protocol.DataProto):
        return output.select_idxs(list(range(len(output) - padding)))
    # A list holds one entry per rank, not per row: verl drops its last `padding` entries (other
    # ranks' outputs); we keep them all.
    return output


def _verl_mesh_infos(group: Any, mesh_name: str) -> list[MeshInfo | None]:
    """Each worker's mesh info from verl's dispatch table (dp_size = max dp_rank + 1)."""
    tables = group.execute_all("get_dispatch_collect")
    dp_ranks = [t["dispatch_dp_rank"].get(mesh_name) for t in tables]
    dp_size = max((r for r in dp_ranks if r is not None), default=0) + 1
    return [
        None
        if r is None or mesh_name not in t["collect_dp_rank"]
        else MeshInfo(dp_rank=int(r), dp_size=dp_size, is_collect=bool(t["collect_dp_rank"][mesh_name]))
        for r, t in zip(dp_ranks, tables)
    ]


class VerlControllerExtension(ControllerExtension):
    """verl's modes, ``register`` marks, ``Worker`` classes and DataProto auto-padding on our controller."""

    name = "verl"

    def translate_modes(self, dispatch_mode: Any, execute_mode: Any, *, method: str) -> tuple[Any, Any] | None:
        """verl's ``Dispatch``/``Execute`` members and nd-dispatch dicts in our terms (see module doc)."""
        return translate_verl_modes(dispatch_mode, execute_mode, method=method)

    def read_registration(self, func: Any, *, method: str) -> Registration | None:
        """The translated ``Registration`` of a method marked by verl's ``register``."""
        modes = verl_registration_modes(func, method=method)
        if modes is None:
            return None
        dispatch_mode, execute_mode, blocking = modes
        if not isinstance(execute_mode, Execute):
            execute_mode = Execute.ALL
        return Registration(dispatch_mode, execute_mode, blocking)

    def claims_worker_class(self, cls: type) -> bool:
        """A subclass of verl's ``Worker``."""
        return is_verl_worker_class(cls)

    def worker_env(self, *, name_prefix: str, local_world_size: int) -> dict[str, str]:
        """What verl's own group sets; verl's ``Worker`` reads ``WG_BACKEND`` for its node address."""
        return {"WG_PREFIX": name_prefix, "WG_BACKEND": "ray", "RAY_LOCAL_WORLD_SIZE": str(local_world_size)}

    def mesh_infos(self, group: Any, mesh_name: str) -> list[MeshInfo | None]:
        """Read from the workers' ``get_dispatch_collect`` table."""
        return _verl_mesh_infos(group, mesh_name)

    def pad_for_even_split(self, args: tuple, kwargs: dict, num_chunks: int) -> tuple[tuple, dict, Callable]:
        """verl's auto-padding of padding-enabled DataProtos; the padding rows are dropped on collect."""
        args, kwargs, padding = pad_for_even_chunks(args, kwargs, num_chunks)
        return args, kwargs, functools.partial(drop_padding, padding=padding)


def install() -> None:
    """Register verl's row containers and the verl extension with the dispatcher (idempotent)."""
    register_row_container("verl.protocol.DataProto", _DATAPROTO_ROWS)
    register_row_container("verl.protocol.DataProtoFuture", _DATAPROTO_FUTURE_ROWS)
    register_row_container(TensorDict, _TENSORDICT_ROWS)
    register_extension(VerlControllerExtension())
