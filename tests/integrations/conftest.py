"""Shared fixtures for the verl integration tests; every test here needs verl (the `verl` extra)."""

from __future__ import annotations

import pytest

from tests._verl import VERL_SKIP_REASON


@pytest.fixture(scope="session")
def verl():
    """The verl package, or skip the test with the install hint."""
    return pytest.importorskip("verl", reason=VERL_SKIP_REASON)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 checkpoint with its tokenizer (``save_pretrained`` layout), built locally."""
    from verl_balance.models.tiny_hf import write_tiny_model

    out = str(tmp_path_factory.mktemp("tiny_qwen2"))
    write_tiny_model(out, family="qwen2")
    return out
