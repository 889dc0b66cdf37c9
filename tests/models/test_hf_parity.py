"""The parity matrix on a Hugging Face model: every layout reproduces the single-process reference."""

from __future__ import annotations

import pytest
import torch

from verl_balance import parity
from verl_balance.models import build_model, load_model_config
from verl_balance.models.tiny_hf import write_tiny_model


@pytest.mark.slow
def test_hf_model_passes_the_parity_matrix_and_controls_fail(tmp_path, monkeypatch):
    # qwen2: q/k/v biases, tied embeddings; one KV head is repeated for sp=2 and sp=4. HF's usual
    # 0.02 init keeps gradients well scaled for the parameter comparison after an Adam step.
    path = write_tiny_model(str(tmp_path / "qwen2"), family="qwen2", num_kv_heads=1, initializer_range=0.02)
    config = load_model_config(name=None, path=path, overrides={}, vocab_size=1)
    # The reference builds its model by type (built-in or HF adapter), same forward signature.
    monkeypatch.setattr(parity, "LlamaForCausalLM", lambda c, attn_impl: build_model(c, attn_impl=attn_impl),
                        raising=False)
    torch.set_num_threads(1)
    jobs = parity.parity_jobs(layouts=((1, 1), (2, 2), (1, 4)), controls=True)
    results = parity.run_layouts(jobs=jobs, settings=parity.ParitySettings(model=config))
    matrix = [r for r in results if r.case.bug is None]
    controls = [r for r in results if r.case.bug is not None]
    assert matrix and all(r.passed for r in matrix), parity.format_table([r for r in matrix if not r.passed])
    assert controls and not any(r.passed for r in controls), parity.format_table(controls, expect_fail=True)
