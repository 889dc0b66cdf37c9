"""Tiny random Hugging Face model directories, written once per session (nothing downloads)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from _tiny_variants import TINY_VARIANTS  # noqa: E402

from verl_balance.models.tiny_hf import write_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """Every TINY_VARIANTS entry written to its own directory."""
    root = tmp_path_factory.mktemp("tiny_hf")
    return {name: write_tiny_model(str(root / name), **kw) for name, kw in TINY_VARIANTS.items()}
