"""Helpers for the trainer tests (the Ray fixture lives in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFIG_DIR = Path(__file__).resolve().parents[2] / "verl_balance" / "config"


def compose_config(name: str, overrides: list[str]):
    """The recipe config exactly as the command line would build it (Hydra compose API)."""
    from hydra import compose, initialize_config_dir

    from verl_balance.trainer.config import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


@pytest.fixture
def tiny_sft_overrides(tmp_path) -> list[str]:
    """A small, fast SFT setup on the synthetic task, shared data dir per test."""
    return [
        "trainer.device=cpu",
        "model.name=tiny",
        "data.train_batch_size=16",
        "data.synthetic.num_train=128",
        "data.synthetic.num_val=32",
        f"data.synthetic.out_dir={tmp_path / 'data'}",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.resume_mode=disable",
    ]
