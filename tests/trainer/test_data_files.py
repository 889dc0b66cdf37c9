"""``trainer.sections.resolve_data_files``, the one place both recipes resolve their data files:
configured files pass through untouched; with ``data.train_files`` null the synthetic task is
generated once under ``data.synthetic.out_dir`` (or ``default_local_dir``/data), from the recipe's
own task settings (GRPO's ``data.synthetic.tasks``), and reused while both files exist."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pyarrow.parquet as pq

from verl_balance.trainer.config.grpo import GRPOSyntheticConfig
from verl_balance.trainer.config.sections import SyntheticDataConfig, resolve_data_files


def _data(synthetic, *, train_files=None, val_files=None) -> SimpleNamespace:
    return SimpleNamespace(train_files=train_files, val_files=val_files, synthetic=synthetic)


def test_configured_files_pass_through_and_nothing_is_generated(tmp_path):
    data = _data(SyntheticDataConfig(), train_files=["/d/train.parquet"], val_files=None)
    assert resolve_data_files(data, kind="sft", default_local_dir=str(tmp_path)) == (["/d/train.parquet"], None)
    assert os.listdir(tmp_path) == []


def test_sft_synthetic_files_are_generated_under_the_run_directory_once(tmp_path):
    data = _data(SyntheticDataConfig(num_train=6, num_val=2))
    train, val = resolve_data_files(data, kind="sft", default_local_dir=str(tmp_path))
    assert (train, val) == (str(tmp_path / "data" / "sft_train.parquet"), str(tmp_path / "data" / "sft_val.parquet"))
    assert (pq.read_metadata(train).num_rows, pq.read_metadata(val).num_rows) == (6, 2)
    # the default task mix (the control for the GRPO test below, which restricts it)
    assert len(set(pq.read_table(tmp_path / "data" / "rl_train.parquet").column("data_source").to_pylist())) > 1
    before = os.stat(train).st_mtime_ns
    data.val_files = "/d/val.parquet"  # a configured validation file wins over the generated one
    assert resolve_data_files(data, kind="sft", default_local_dir=str(tmp_path)) == (train, "/d/val.parquet")
    assert os.stat(train).st_mtime_ns == before  # reused, not regenerated


def test_rl_synthetic_files_follow_the_recipes_task_settings(tmp_path):
    out_dir = tmp_path / "elsewhere"
    data = _data(GRPOSyntheticConfig(num_train=8, num_val=2, tasks=["reverse"], out_dir=str(out_dir)))
    train, val = resolve_data_files(data, kind="rl", default_local_dir=str(tmp_path / "run"))
    assert (train, val) == (str(out_dir / "rl_train.parquet"), str(out_dir / "rl_val.parquet"))
    assert set(pq.read_table(train).column("data_source").to_pylist()) == {"synthetic/reverse"}
    assert not (tmp_path / "run").exists()
