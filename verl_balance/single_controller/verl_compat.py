"""verl compatibility: verl's ``register`` marks, ``Dispatch`` members and row containers, read lazily.

verl is optional. Nothing here imports it: a verl object can only exist if its module is already
in ``sys.modules``, so every check looks there first and answers "not verl" otherwise.

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

Row containers: a verl ``DataProto`` (or ``DataProtoFuture``) and a ``TensorDict`` are split
by verl's own ``chunk`` into equal pieces; lengths that do not divide are a ``DispatchError``
(verl asserts), except a ``DataProto`` with auto-padding enabled (``meta_info`` key
``_verl_auto_padding`` or ``DataProtoConfig.auto_padding``) under DP_COMPUTE_PROTO /
DP_COMPUTE_METRIC: like verl, it is padded with copies of its last row and the padding rows
are dropped from the collected output. Unlike verl, the caller's DataProto is not modified.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict

__all__ = [
    "VERL_MAGIC_ATTR",
    "UnsupportedDispatch",
    "is_verl_worker_class",
    "translate_verl_modes",
    "verl_registration_modes",
    "chunk_verl_rows",
    "concat_verl_rows",
    "pad_for_even_chunks",
    "drop_padding",
]

VERL_MAGIC_ATTR = "attrs_3141562937"
"""The attribute verl's ``register`` sets on a worker method (a dict of dispatch/execute/blocking)."""

_VERL_DECORATOR = "verl.single_controller.base.decorator"
_VERL_WORKER = "verl.single_controller.base.worker"
_VERL_PROTOCOL = "verl.protocol"
_ND_DISPATCH_FN = "dispatch_lazy_compute_data_proto"


@dataclass(frozen=True)
class UnsupportedDispatch:
    """A verl dispatch mode we have no equivalent for; calling the group method raises ``reason``."""

    reason: str


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
    """Our (dispatch, execute) modes for verl's, an ``UnsupportedDispatch``, or None if not verl's.

    Returns None when neither mode is a verl object (the caller then treats them as ours).
    """
    from verl_balance.single_controller.decorator import Dispatch, Execute, MeshDispatch

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
    attrs = getattr(func, VERL_MAGIC_ATTR, None)
    if not isinstance(attrs, dict) or "dispatch_mode" not in attrs:
        return None
    modes = translate_verl_modes(attrs["dispatch_mode"], attrs.get("execute_mode"), method=method)
    if modes is None:  # marked by verl's register with modes verl would reject: be explicit anyway
        modes = UnsupportedDispatch(f"{method}: unrecognised verl registration {attrs!r}"), attrs.get("execute_mode")
    return modes[0], modes[1], bool(attrs.get("blocking", True))


def _divisible_or_raise(length: int, num_chunks: int, *, name: str, kind: str) -> None:
    from verl_balance.single_controller.decorator import DispatchError

    if length % num_chunks:
        raise DispatchError(
            f"argument {name}: a {kind} of {length} rows cannot be split evenly into {num_chunks} chunks "
            f"(verl's chunk requires equal pieces); pass a multiple of {num_chunks} rows"
            + (
                ", or enable auto-padding (meta_info['_verl_auto_padding']=True) under DP_COMPUTE_PROTO"
                if kind == "DataProto"
                else ""
            )
        )


def chunk_verl_rows(value: Any, num_chunks: int, *, name: str) -> list | None:
    """``num_chunks`` equal row chunks of a DataProto / DataProtoFuture / TensorDict, None for other values."""
    from verl_balance.single_controller.decorator import DispatchError

    protocol = _module(_VERL_PROTOCOL)
    if isinstance(value, TensorDict):
        if protocol is None:
            raise DispatchError(
                f"argument {name} is a bare TensorDict: wrap it in verl_balance.protocol.Batch to split it over "
                "the workers (or import verl, whose chunk_tensordict splits it)"
            )
        _divisible_or_raise(value.batch_size[0], num_chunks, name=name, kind="TensorDict")
        return list(protocol.BatchData(value).chunk(chunks=num_chunks))
    if protocol is None:
        return None
    if isinstance(value, protocol.DataProto):
        _divisible_or_raise(len(value), num_chunks, name=name, kind="DataProto")
        return value.chunk(num_chunks)
    if isinstance(value, protocol.DataProtoFuture):
        return value.chunk(num_chunks)
    return None


def concat_verl_rows(outputs: list) -> Any | None:
    """verl's concatenation of per-rank DataProtos / TensorDicts (all one type), None for other outputs."""
    protocol = _module(_VERL_PROTOCOL)
    if protocol is None or not outputs:
        return None
    kind = type(outputs[0])
    if not issubclass(kind, (protocol.DataProto, TensorDict)) or any(type(o) is not kind for o in outputs):
        return None
    return protocol.BatchData(list(outputs)).concat()


def pad_for_even_chunks(args: tuple, kwargs: dict, num_chunks: int) -> tuple[tuple, dict, int]:
    """verl's DP_COMPUTE_PROTO auto-padding: pad padding-enabled DataProtos to a multiple of ``num_chunks``.

    Returns the new (args, kwargs) and the number of padding rows (0 if nothing was padded). The
    inputs are not modified.
    """
    from verl_balance.single_controller.decorator import DispatchError

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
