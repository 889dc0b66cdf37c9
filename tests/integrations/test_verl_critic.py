"""verl 0.9.1's own critic (PPO with GAE) with ``critic.strategy=verl_balance`` gives the same values,
``critic/vf_loss`` and critic grad norm as verl's ``fsdp2`` critic on the same batch (rtol 1e-5).

The pieces are verl's, unmodified: ``RayPPOTrainer._compute_values`` -> ``compute_advantage`` (GAE)
-> ``_update_critic`` with verl's ``TrainingWorker`` (``model_type="value_model"``, built as
``RayPPOTrainer.init_workers`` builds the critic) in a verl ``RayWorkerGroup`` of 2 CPU workers
(``verl_critic_pieces_runner.py``, one subprocess on the session's Ray cluster, fresh workers per
case). The critic directory is a ``Qwen2ForTokenClassification(num_labels=1)`` checkpoint, so both
engines load the same head. The reference fsdp2 critic loads it with sdpa attention instead of verl's
hard-coded flash-attention (``verl_value_sdpa.py``; CPU hosts have no flash-attn).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests._verl import VERL_SKIP_REASON
from tests.integrations.verl_ray_head import runner_env
from verl_balance.testing.forked_workers import python_command

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

HERE = os.path.dirname(os.path.abspath(__file__))
EXTERNAL_MODULES = ",".join(
    ["verl_balance.integrations.verl.cpu_shims.platform", "verl_balance.integrations.verl.engine", "verl_value_sdpa"]
)


@pytest.fixture(scope="module")
def critic_model_dir(tmp_path_factory):
    """A tiny Qwen2 (HF's usual 0.02 init: activations of order 0.1, so fp32 rounding stays far
    below the tolerance) saved as a ``Qwen2ForTokenClassification(num_labels=1)`` directory."""
    import torch
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    from verl_balance.models.tiny_hf import write_tiny_model

    root = tmp_path_factory.mktemp("tiny_qwen2_critic")
    lm_dir = write_tiny_model(str(root / "lm"), family="qwen2", initializer_range=0.02)
    torch.manual_seed(5)
    critic = AutoModelForTokenClassification.from_pretrained(lm_dir, num_labels=1, dtype=torch.float32)
    critic.save_pretrained(str(root / "critic"))
    AutoTokenizer.from_pretrained(lm_dir).save_pretrained(str(root / "critic"))
    return str(root / "critic")


def _run_cases(model_dir: str, cases: list[str], *, ray_address: str) -> dict[str, dict]:
    """{case: result} from one ``verl_critic_pieces_runner.py`` process (on the session's Ray cluster)."""
    env = runner_env(ray_address, VERL_USE_EXTERNAL_MODULES=EXTERNAL_MODULES)
    args = python_command([os.path.join(HERE, "verl_critic_pieces_runner.py"), "--model-dir", model_dir])
    for case in cases:
        args += ["--case", case]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    results = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert [r["case"] for r in results] == cases, proc.stdout[-3000:]
    return {r["case"]: r for r in results}


@pytest.fixture(scope="module")
def critic_results(critic_model_dir, ray_head):
    cases = ["fsdp2:1:1", "fsdp2:2:1", "verl_balance:2:1", "verl_balance:1:2"]
    return _run_cases(critic_model_dir, cases, ray_address=ray_head)


def _assert_same_critic_step(ours: dict, reference: dict, *, rel: float = 1e-5) -> None:
    assert ours["values"] == pytest.approx(reference["values"], rel=rel, abs=1e-6)
    assert ours["returns_sum"] == pytest.approx(reference["returns_sum"], rel=rel)
    assert len(ours["vf_loss"]) == len(reference["vf_loss"])
    assert ours["vf_loss"] == pytest.approx(reference["vf_loss"], rel=rel)
    assert ours["grad_norm"] == pytest.approx(reference["grad_norm"], rel=rel)
    # vf_clipfrac / vpred_mean are verl's per-micro-batch means: they depend on the micro-batching,
    # which differs (our balanced plan); vf_loss (a SUM metric) is the global objective.


@pytest.mark.slow
def test_critic_on_verl_balance_matches_verl_fsdp2_critic_over_two_mini_batches(critic_results):
    reference = critic_results["fsdp2:2:1"]
    assert len(reference["vf_loss"]) == 2
    # The second mini-batch follows an optimizer step: its loss and norm check the update too.
    assert reference["grad_norm"][0] != pytest.approx(reference["grad_norm"][1], rel=1e-3)
    assert max(reference["vf_clipfrac"]) > 0, "the second mini-batch must clip some values"
    _assert_same_critic_step(critic_results["verl_balance:2:1"], reference)


@pytest.mark.slow
def test_critic_on_verl_balance_with_ulysses_sp2_matches_verl_fsdp2_critic(critic_results):
    # One mini-batch: verl forms mini-batches from each DP rank's rows, so with several mini-batches
    # DP1 (sp2 on 2 workers) and DP2 train on different row sets; one mini-batch is the same rows.
    reference = critic_results["fsdp2:1:1"]
    assert len(reference["vf_loss"]) == 1
    _assert_same_critic_step(critic_results["verl_balance:1:2"], reference)
