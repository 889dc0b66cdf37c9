"""The parity matrix on a Hugging Face model: every layout reproduces the single-process reference."""

from __future__ import annotations

import pytest
import torch

from verl_balance import parity
from verl_balance.models import load_model_config
from verl_balance.models.tiny_hf import write_tiny_model


@pytest.mark.slow
def test_hf_model_passes_the_parity_matrix_and_controls_fail(tmp_path):
    # qwen2: q/k/v biases, tied embeddings; one KV head is repeated for sp=2 and sp=4. HF's usual
    # 0.02 init keeps gradients well scaled for the parameter comparison after an Adam step.
    path = write_tiny_model(str(tmp_path / "qwen2"), family="qwen2", num_kv_heads=1, initializer_range=0.02)
    config = load_model_config(name=None, path=path, overrides={}, vocab_size=1)
    torch.set_num_threads(1)
    jobs = parity.parity_jobs(layouts=((1, 1), (2, 2), (1, 4)), controls=True, fsdp=False)
    results = parity.run_layouts(jobs=jobs, settings=parity.ParitySettings(model=config))
    matrix = [r for r in results if r.case.bug is None]
    controls = [r for r in results if r.case.bug is not None]
    assert matrix and all(r.passed for r in matrix), parity.format_table([r for r in matrix if not r.passed])
    assert controls and not any(r.passed for r in controls), parity.format_table(controls, expect_fail=True)


@pytest.mark.slow
def test_parity_cli_takes_a_model_path(tmp_path, capsys):
    """`python -m verl_balance.parity model.path=DIR` runs the matrix on that model."""
    path = write_tiny_model(str(tmp_path / "llama"), family="llama", num_kv_heads=1, initializer_range=0.02)
    assert parity.main([f"model.path={path}", "--layouts", "1x1,2x1", "--no-controls", "--no-fsdp"]) == 0
    out = capsys.readouterr().out
    assert "HFModelConfig" in out and "32/32 matrix cells pass" in out  # 2 layouts x 16 cells
