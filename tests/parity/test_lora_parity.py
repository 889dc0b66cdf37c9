"""LoRA rows of the parity matrix: a LoRA run (tiny HF qwen2, rank 4 on every decoder Linear, A and B
non-zero from a peft adapter directory) reproduces the single-process reference on every layout of
the matrix, with fixed and dynamic micro-batches and every loss_agg_mode: eval and train loss, the
gradient norm (over the adapters only) and every parameter after one AdamW step (the frozen base
included). Known-bad normalizers must still fail.

Reference: verl_balance.parity.reference_steps on the HF model with peft's adapters injected and
loaded from the same adapter directory, only the adapters trainable (plain per-sequence forward,
torch AdamW); no distributed, packing or loss-contract code.
"""

import pytest

from verl_balance import parity
from verl_balance.testing.faults import KNOWN_BUGS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_results(tmp_path_factory):
    import torch

    torch.set_num_threads(1)
    model_dir, adapter_dir = parity.write_lora_fixture(str(tmp_path_factory.mktemp("lora_parity")))
    results = parity.run_layouts(jobs=parity.lora_parity_jobs(), settings=parity.lora_settings(model_dir, adapter_dir))
    print("\n" + parity.format_table(results))
    return results


@pytest.mark.parametrize("layout", parity.PARITY_LAYOUTS, ids=lambda lay: f"dp{lay[0]}_sp{lay[1]}")
def test_lora_run_matches_the_single_process_reference_on_every_layout(lora_results, layout):
    cells = [r for r in lora_results if r.layout == layout and r.case.bug is None]
    assert [c.case for c in cells] == parity.lora_cases()
    failed = [r for r in cells if not r.passed]
    assert not failed, "\n" + parity.format_table(failed)


@pytest.mark.parametrize("layout, case", parity.LORA_NEGATIVE_CONTROLS, ids=lambda x: getattr(x, "bug", None) or "")
def test_known_bad_normalizer_breaks_lora_parity(lora_results, layout, case):
    [result] = [r for r in lora_results if r.layout == layout and r.case == case]
    assert not result.passed, f"negative control {KNOWN_BUGS[case.bug]} went undetected on the LoRA run"
