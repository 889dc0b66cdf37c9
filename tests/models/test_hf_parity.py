"""The parity matrix on a Hugging Face model: every layout reproduces the single-process reference."""

from __future__ import annotations

import functools

import pytest
import torch
from _tiny_variants import NEW_FAMILY_VARIANTS

from verl_balance import parity
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.models import load_model_config
from verl_balance.models.tiny_hf import write_tiny_model


@pytest.mark.slow
def test_hf_model_passes_the_parity_matrix_and_controls_fail(tmp_path):
    # qwen2: q/k/v biases, tied embeddings; one KV head is repeated for sp=2 and sp=4. HF's usual
    # 0.02 init keeps gradients well scaled for the parameter comparison after an Adam step.
    path = write_tiny_model(str(tmp_path / "qwen2"), family="qwen2", num_kv_heads=1, initializer_range=0.02)
    config = load_model_config(name=None, path=path, overrides={}, vocab_size=1)
    torch.set_num_threads(1)
    jobs = parity.parity_jobs(layouts=((1, 1), (2, 2), (1, 4)), controls=True, fsdp=False, values=False)
    results = parity.run_layouts(jobs=jobs, settings=parity.ParitySettings(model=config))
    matrix = [r for r in results if r.case.bug is None]
    controls = [r for r in results if r.case.bug is not None]
    assert matrix and all(r.passed for r in matrix), parity.format_table([r for r in matrix if not r.passed])
    assert controls and not any(r.passed for r in controls), parity.format_table(controls, expect_fail=True)


@pytest.mark.slow
def test_parity_cli_takes_a_model_path(tmp_path, capsys):
    """`python -m verl_balance.parity model.path=DIR` runs the matrix on that model."""
    path = write_tiny_model(str(tmp_path / "llama"), family="llama", num_kv_heads=1, initializer_range=0.02)
    assert parity.main([f"model.path={path}", "--layouts", "1x1,2x1", "--no-controls", "--no-fsdp", "--no-values"]) == 0
    out = capsys.readouterr().out
    assert "HFModelConfig" in out and "32/32 matrix cells pass" in out  # 2 layouts x 16 cells


FAMILY_LAYOUT = (1, 2)
FAMILY_CASE = parity.ParityCase(micro="dynamic", balance=True, agg_mode="seq-mean-token-mean")


def _family_rows(rank: int, *, settings_by_family: dict, references: dict, case) -> dict | None:
    """Every family's row inside one gloo group of 2 ranks (one spawn for all families)."""
    torch.set_num_threads(1)
    rows = {}
    for family, settings in settings_by_family.items():
        [(_, eval_loss, train_loss, grad_norm, delta)] = parity._run_cases(
            dp=FAMILY_LAYOUT[0], sp=FAMILY_LAYOUT[1], cases=[case], settings=settings, references=references[family]
        )
        rows[family] = (eval_loss, train_loss, grad_norm, delta)
    return rows if rank == 0 else None


@pytest.fixture(scope="module")
def family_parity_rows(tmp_path_factory) -> dict[str, parity.ParityResult]:
    root = tmp_path_factory.mktemp("parity_families")
    settings = {}
    for family in NEW_FAMILY_VARIANTS:
        path = write_tiny_model(str(root / family), family=family, initializer_range=0.02)
        model = load_model_config(name=None, path=path, overrides={}, vocab_size=1)
        settings[family] = parity.ParitySettings(model=model)
    torch.set_num_threads(1)
    references = {family: parity.reference_steps(s, agg_modes=[FAMILY_CASE.agg_mode]) for family, s in settings.items()}
    rows = run_on_ranks(
        functools.partial(_family_rows, settings_by_family=settings, references=references, case=FAMILY_CASE), world=2
    )[0]
    results = {}
    for family, (eval_loss, train_loss, grad_norm, delta) in rows.items():
        ref = references[family][FAMILY_CASE.agg_mode]
        results[family] = parity.ParityResult(
            layout=FAMILY_LAYOUT,
            case=FAMILY_CASE,
            ref_loss=ref["loss"],
            eval_loss=eval_loss,
            train_loss=train_loss,
            ref_grad_norm=ref["grad_norm"],
            grad_norm=grad_norm,
            max_param_delta=delta,
        )
    return results


@pytest.mark.slow
@pytest.mark.parametrize("family", NEW_FAMILY_VARIANTS)
def test_family_parity_row_dp1_sp2_matches_the_single_process_reference(family_parity_rows, family):
    """One row per family (FSDP2 over 2 ranks, Ulysses sp=2, dynamic balanced micro-batches, one
    Adam step) against the plain per-sequence reference; the full matrix runs on qwen2 above."""
    result = family_parity_rows[family]
    assert result.passed, parity.format_table([result])
