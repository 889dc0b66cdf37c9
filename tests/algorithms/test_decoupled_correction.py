"""algorithm.rollout_correction in verl's decoupled mode (the driver's whole batch): IS weights, the
rejection-modified response mask and the logged statistics equal verl 0.9.1's
``compute_rollout_correction_and_rejection_mask`` on random inputs; a hand-worked example."""

from __future__ import annotations

import math

import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.algorithms.rollout_correction import RolloutCorrectionConfig, decoupled_correction

CASES = [
    RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.3),
    RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=2.0),
    RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold="0.8_1.3"),
    RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True),
    RolloutCorrectionConfig(rollout_is="token", rollout_is_batch_normalize=True),
    RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25"),
    RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=1.2, rollout_rs="token_k2,seq_mean_k3", rollout_rs_threshold="0.02"
    ),
    RolloutCorrectionConfig(rollout_is="sequence", rollout_rs="seq_sum_k1,seq_max_k2", rollout_rs_threshold="3.0,0.05"),
]
LOGGED = (
    "rollout_corr/rollout_is_mean",
    "rollout_corr/rollout_is_batch_norm_factor",
    "rollout_corr/rollout_rs_masked_fraction",
    "rollout_corr/rollout_rs_seq_masked_fraction",
)


def make_inputs(seed: int, rows: int = 10, width: int = 14, spread: float = 0.15):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[0] = 0  # an empty row: no weight, not a sequence of the batch means
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    rollout = -torch.rand(rows, width, generator=gen) * 2.5
    old = rollout + spread * torch.randn(rows, width, generator=gen)
    return old * mask, rollout * mask, mask


@pytest.mark.parametrize("case", range(len(CASES)))
def test_decoupled_correction_equals_verl(case):
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason=VERL_SKIP_REASON)
    config = CASES[case]
    old, rollout, mask = make_inputs(case)
    weights, new_mask, metrics = decoupled_correction(
        old_log_probs=old, rollout_log_probs=rollout, loss_mask=mask, config=config
    )
    want_weights, want_mask, want_metrics = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old,
        rollout_log_prob=rollout,
        response_mask=mask,
        rollout_is=config.rollout_is,
        rollout_is_threshold=config.rollout_is_threshold,
        rollout_is_batch_normalize=config.rollout_is_batch_normalize,
        rollout_rs=config.rollout_rs,
        rollout_rs_threshold=config.rollout_rs_threshold,
    )
    torch.testing.assert_close(new_mask, want_mask, rtol=0, atol=0)
    if config.rollout_is is None:
        assert weights is None and want_weights is None
    else:
        torch.testing.assert_close(weights, want_weights.batch["rollout_is_weights"], rtol=1e-6, atol=1e-7)
    assert set(metrics) == {k for k in LOGGED if k in want_metrics}
    for key, value in metrics.items():
        assert value == pytest.approx(want_metrics[key], rel=1e-6, abs=1e-9), key


def test_the_cases_exercise_truncation_and_rejection():
    """Guard on the cases: some weights are bounded and some tokens rejected (not none, not all)."""
    for case, config in enumerate(CASES):
        old, rollout, mask = make_inputs(case)
        weights, new_mask, _ = decoupled_correction(
            old_log_probs=old, rollout_log_probs=rollout, loss_mask=mask, config=config
        )
        on = mask > 0
        if config.rollout_rs is not None:
            assert 0 < int((new_mask[on] == 0).sum()) < int(on.sum()), case
        if weights is not None and not config.rollout_is_batch_normalize:
            upper = float(str(config.rollout_is_threshold).split("_")[-1])
            bounded = (weights[on] == 0) if "_" in str(config.rollout_is_threshold) else (weights[on] == upper)
            assert bounded.any() and not bounded.all(), case


def test_hand_worked_token_tis_and_token_k1_rejection():
    old = torch.tensor([[math.log(0.5), math.log(0.9), 0.0]])
    rollout = torch.tensor([[math.log(0.25), math.log(0.9), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    config = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=1.5)
    weights, new_mask, metrics = decoupled_correction(
        old_log_probs=old, rollout_log_probs=rollout, loss_mask=mask, config=config
    )
    # ratios 2 and 1, truncated at 1.5; padding 0
    torch.testing.assert_close(weights, torch.tensor([[1.5, 1.0, 0.0]]))
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.25)
    assert torch.equal(new_mask, mask)  # no rejection configured
    reject = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold=1.5)
    # token_k1 = -log ratio: -log 2 < log(1 / 1.5) is rejected, 0 is kept
    _, rejected, metrics = decoupled_correction(
        old_log_probs=old, rollout_log_probs=rollout, loss_mask=mask, config=reject
    )
    torch.testing.assert_close(rejected, torch.tensor([[0.0, 1.0, 0.0]]))
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(0.5)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == 1.0


def test_a_batch_without_response_tokens_is_an_error():
    zeros = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="algorithm.rollout_correction"):
        decoupled_correction(
            old_log_probs=zeros,
            rollout_log_probs=zeros,
            loss_mask=zeros,
            config=RolloutCorrectionConfig(rollout_is="token"),
        )
