"""What the dispatcher learns from outside: row containers and controller extensions.

A value whose type is registered as a row container is split into row chunks by the DP dispatch
modes and concatenated back by collect; any other value goes whole to every rank. Types are
registered by qualified name and looked up along the MRO, never importing the package. A bare
``TensorDict`` is refused (no silent broadcast).

A ``ControllerExtension`` lets another framework's workers run here; every hook's default answers
"not mine". This module imports no framework.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensordict import TensorDict

from verl_balance.protocol import Batch
from verl_balance.single_controller.modes import DispatchError, MeshInfo, Registration

__all__ = [
    "ControllerExtension",
    "RowContainer",
    "concat_rows",
    "extension_for_worker_class",
    "extensions",
    "pad_for_even_split",
    "read_registration",
    "register_extension",
    "register_row_container",
    "row_container_of",
    "split_rows",
    "translate_modes",
]


@dataclass(frozen=True)
class RowContainer:
    """How the dispatcher handles one container type of rows.

    ``split(value, n)``: ``n`` row chunks in order; ``concat(outputs)``: one value (None: a list);
    ``length(value)``: rows or None; ``even_only``: an uneven split is a ``DispatchError`` (plus
    ``uneven_hint``); ``refusal(value)``: why it cannot be split, or None.
    """

    split: Callable[[Any, int], list]
    concat: Callable[[list], Any] | None
    length: Callable[[Any], int | None]
    even_only: bool = False
    uneven_hint: str = ""
    refusal: Callable[[Any], str | None] | None = None


_CONTAINERS: dict[str, RowContainer] = {}


def _qualified_name(kind: type | str) -> str:
    return kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"


def register_row_container(kind: type | str, container: RowContainer) -> None:
    """Split/concat ``kind`` (a type, or its ``module.QualName``) as rows; replaces an earlier registration."""
    _CONTAINERS[_qualified_name(kind)] = container


def row_container_of(value: Any) -> RowContainer | None:
    """The registration of ``value``'s type or its nearest registered base class, or None."""
    for klass in type(value).__mro__:
        container = _CONTAINERS.get(_qualified_name(klass))
        if container is not None:
            return container
    return None


def split_rows(value: Any, num_chunks: int, *, name: str) -> list | None:
    """``num_chunks`` row chunks of a registered container, None for any other value."""
    container = row_container_of(value)
    if container is None:
        return None
    reason = container.refusal(value) if container.refusal is not None else None
    if reason:
        raise DispatchError(f"argument {name} is a {reason}")
    length = container.length(value)
    if container.even_only and length is not None and length % num_chunks:
        raise DispatchError(
            f"argument {name}: a {type(value).__name__} of {length} rows cannot be split evenly into "
            f"{num_chunks} chunks; pass a multiple of {num_chunks} rows{container.uneven_hint}"
        )
    return container.split(value, num_chunks)


def concat_rows(outputs: list) -> Any:
    """Per-rank outputs of one registered container joined by its ``concat``; otherwise the list unchanged."""
    if not outputs:
        return outputs
    container = row_container_of(outputs[0])
    if container is None or container.concat is None:
        return outputs
    if any(row_container_of(o) is not container for o in outputs):
        return outputs
    return container.concat(outputs)


register_row_container(
    Batch,
    RowContainer(split=lambda batch, n: batch.chunk(n), concat=Batch.concat, length=len),
)
register_row_container(
    TensorDict,
    RowContainer(
        split=lambda td, n: [],
        concat=None,
        length=lambda td: None,
        refusal=lambda td: (
            "bare TensorDict: wrap it in verl_balance.protocol.Batch to split it over the workers (or import "
            "an integration that registers TensorDict rows, e.g. verl_balance.integrations.verl)"
        ),
    ),
)


class ControllerExtension:
    """Hooks through which another framework's workers and data run on this controller; every
    default answers "not mine", so hooks compose in install order.
    """

    name = "extension"

    def translate_modes(self, dispatch_mode: Any, execute_mode: Any, *, method: str) -> tuple[Any, Any] | None:
        """Our (dispatch, execute) modes for the framework's mode objects passed to our ``register``."""
        return None

    def read_registration(self, func: Any, *, method: str) -> Registration | None:
        """Our ``Registration`` of a worker method marked by the framework's own ``register``."""
        return None

    def claims_worker_class(self, cls: type) -> bool:
        """Whether ``cls`` is one of the framework's worker classes."""
        return False

    def worker_env(self, *, name_prefix: str, local_world_size: int) -> dict[str, str]:
        """Extra environment variables for every worker of a claimed class."""
        return {}

    def mesh_infos(self, group: Any, mesh_name: str) -> list[MeshInfo | None]:
        """Every worker's mesh registration for ``mesh_name`` (claimed worker classes only)."""
        raise NotImplementedError(f"{type(self).__name__} claims worker classes but cannot read their meshes")

    def pad_for_even_split(self, args: tuple, kwargs: dict, num_chunks: int) -> tuple[tuple, dict, Callable]:
        """Padded (args, kwargs) for a DP split and the function that unpads the output."""
        return args, kwargs, _unchanged


def _unchanged(output: Any) -> Any:
    return output


_EXTENSIONS: list[ControllerExtension] = []


def register_extension(extension: ControllerExtension) -> None:
    """Install ``extension`` (idempotent per extension class: a second one of the same class replaces it)."""
    _EXTENSIONS[:] = [e for e in _EXTENSIONS if type(e) is not type(extension)]
    _EXTENSIONS.append(extension)


def extensions() -> tuple[ControllerExtension, ...]:
    """The installed extensions, in install order."""
    return tuple(_EXTENSIONS)


def translate_modes(dispatch_mode: Any, execute_mode: Any, *, method: str) -> tuple[Any, Any] | None:
    """The first installed extension's translation of foreign modes, or None (the modes are ours)."""
    for extension in _EXTENSIONS:
        translated = extension.translate_modes(dispatch_mode, execute_mode, method=method)
        if translated is not None:
            return translated
    return None


def read_registration(func: Any, *, method: str) -> Registration | None:
    """A foreign ``register`` mark of ``func`` read by an installed extension, or None."""
    for extension in _EXTENSIONS:
        registration = extension.read_registration(func, method=method)
        if registration is not None:
            return registration
    return None


def extension_for_worker_class(cls: type) -> ControllerExtension | None:
    """The installed extension that claims ``cls`` as its framework's worker, or None (one of ours)."""
    return next((e for e in _EXTENSIONS if e.claims_worker_class(cls)), None)


def pad_for_even_split(args: tuple, kwargs: dict, num_chunks: int) -> tuple[tuple, dict, Callable]:
    """Every installed extension's padding for a DP split, and one function undoing all of it."""
    undo: list[Callable] = []
    for extension in _EXTENSIONS:
        args, kwargs, unpad = extension.pad_for_even_split(args, kwargs, num_chunks)
        undo.append(unpad)

    def remove_padding(output: Any) -> Any:
        for unpad in reversed(undo):
            output = unpad(output)
        return output

    return args, kwargs, remove_padding
