"""Hide torch extension packages that cannot load on this interpreter's torch.

Invariant: with a CPU torch, an installed torchvision/torchaudio/torchcodec whose version has no
``+cpu`` label is marked absent in ``sys.modules`` (``None``) before anything imports it, so
transformers still imports. With a CUDA torch or a ``+cpu`` extension nothing changes.
"""

from __future__ import annotations

import importlib.metadata
import sys

EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def unloadable_extensions() -> tuple[str, ...]:
    """The installed extensions that are not CPU builds, when torch is a CPU build (else none)."""
    torch_version = _version("torch")
    if torch_version is None or not torch_version.endswith("+cpu"):
        return ()
    return tuple(name for name in EXTENSIONS if (v := _version(name)) is not None and not v.endswith("+cpu"))


def hide_unloadable_extensions() -> tuple[str, ...]:
    """Mark each of ``unloadable_extensions()`` not yet imported as absent; returns the ones hidden."""
    hidden = tuple(name for name in unloadable_extensions() if name not in sys.modules)
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # the import system's "not installed" mark
    return hidden
