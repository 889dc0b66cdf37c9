"""main_grpo with LoRA (actor_rollout_ref.model.lora_rank > 0) on a tiny HF model, end to end: two
steps with the KL loss (reference = base model, adapters disabled), the adapters train, and the
rollout's log-probs (merged weights) match the trainer's old log-probs as closely as a run
without LoRA does.

Reference: the same GRPO run with lora_rank=0 (its rollout-vs-trainer gap is the bar).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def grpo_runs(hf_grpo_runs):
    """The training steps of the shared LoRA and full fine-tuning GRPO runs (tests/trainer/conftest.py)."""
    return {name: [r for r in hf_grpo_runs[name] if "critic/score/mean" in r] for name in ("lora", "full")}


def test_grpo_with_lora_runs_two_steps_with_the_kl_loss(grpo_runs):
    train = grpo_runs["lora"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean"):
            assert np.isfinite(r[key]), key
        assert r["actor/grad_norm"] > 0
    # After updates of the adapters the actor has moved away from the reference (the base model):
    # a reference that followed the actor would give KL 0.
    assert train[1]["actor/kl_loss"] > 1e-7


def test_lora_rollout_log_probs_match_the_trainer_as_closely_as_full_fine_tuning(grpo_runs):
    for name in ("lora", "full"):
        assert all("training/rollout_probs_diff_max" in r for r in grpo_runs[name]), name
    lora = max(r["training/rollout_probs_diff_max"] for r in grpo_runs["lora"])
    full = max(r["training/rollout_probs_diff_max"] for r in grpo_runs["full"])
    print(f"training/rollout_probs_diff_max: lora {lora:.3e}, full {full:.3e}")
    # fp32 on CPU: both gaps are last-bit differences between two forwards (merged vs unmerged).
    assert lora < max(10 * full, 1e-5), (lora, full)
