"""verl's CPU tests of ``agg_loss`` run against our loss contract (no verl import).

Adapts ``tests/trainer/ppo/test_loss_aggregation_on_cpu.py`` of verl-project/verl at commit
1dda039b9c6311889a9c9a26040677e1254814f9 (the file as last changed in 4730d46b). Each upstream
case keeps its data, expected value and property; where it calls verl's ``core_algos.agg_loss``
it calls, in turn, our two implementations of the same contract:

- ``integrations.verl.loss.agg_loss``, our replacement of verl's ``agg_loss`` for one
  (bs, response_length) micro-batch: verl's ``dp_size`` is our ``grad_scale`` (G), verl's global
  normalisers are our ``counts`` (``loss_counts`` over the whole mini-batch);
- ``loss.compute_token_weights``, the engine's weights function: a rank back-propagates
  G * sum(w * l) over its micro-batches (the contract of loss.py). Several DP ranks are one call
  over all their micro-batches, which is what the DP group's all-reduce SUM of the counts gives.

Cases: 6 upstream, each run on both boundaries (12). Before this adaptation the first boundary
failed ``test_token_sum_is_microbatch_invariant`` for 2 and 4 micro-batches (48 and 96 summed
where the whole batch gives 192): ``agg_loss`` rescaled token-sum weights by the micro-batch's
share of sequences; verl was right, ours was fixed.
"""

from __future__ import annotations

import pytest
import torch

from verl_balance.integrations.verl.loss import agg_loss, loss_counts
from verl_balance.loss import compute_token_weights


def _integration_losses(loss_mats, masks, *, mode, grad_scale=1.0):
    """verl's per-micro-batch agg_loss calls, made with ours: counts over every micro-batch given."""
    counts = loss_counts(list(masks))
    return [agg_loss(m, k, mode, counts=counts, grad_scale=grad_scale) for m, k in zip(loss_mats, masks)]


def _engine_losses(loss_mats, masks, *, mode, grad_scale=1.0):
    """G * sum(w * l) per micro-batch, w from one weights call over the mini-batch (rows = sequences)."""
    flat = [k.reshape(-1) for k in masks]
    cu = [torch.arange(k.shape[0] + 1) * k.shape[1] for k in masks]
    weights = compute_token_weights(loss_masks=flat, cu_seqlens=cu, agg_mode=mode, dp_group=None).weights
    return [grad_scale * (w * m.reshape(-1)).sum() for w, m in zip(weights, loss_mats)]


BOUNDARIES = {"integration_agg_loss": _integration_losses, "engine_weights": _engine_losses}


@pytest.mark.parametrize("boundary", sorted(BOUNDARIES))
def test_token_sum_masks_tokens_and_scales_for_dp(boundary):
    loss_mat = torch.tensor([[1.0, 2.0, 30.0], [4.0, 50.0, 6.0]])
    loss_mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])

    (loss,) = BOUNDARIES[boundary]([loss_mat], [loss_mask], mode="token-sum", grad_scale=4)

    assert loss.item() == pytest.approx((1.0 + 2.0 + 4.0 + 6.0) * 4)


@pytest.mark.parametrize("boundary", sorted(BOUNDARIES))
@pytest.mark.parametrize("num_micro_batches", [1, 2, 4])
def test_token_sum_is_microbatch_invariant(boundary, num_micro_batches):
    loss_mat = torch.arange(1, 25, dtype=torch.float32).reshape(8, 3)
    loss_mask = torch.tensor([[1.0, 1.0, 0.0]] * 8)
    step = loss_mat.shape[0] // num_micro_batches
    aggregate = BOUNDARIES[boundary]

    accumulated = sum(aggregate(loss_mat.split(step), loss_mask.split(step), mode="token-sum"))
    (whole,) = aggregate([loss_mat], [loss_mask], mode="token-sum")

    torch.testing.assert_close(accumulated, whole)
    assert whole.item() == pytest.approx(float((loss_mat * loss_mask).sum()))  # 192, the masked sum


@pytest.mark.parametrize("boundary", sorted(BOUNDARIES))
@pytest.mark.parametrize("dp_size", [2, 4])
def test_token_sum_matches_global_sum_after_fsdp_mean_reduction(boundary, dp_size):
    loss_mat = torch.arange(1, 25, dtype=torch.float32).reshape(8, 3)
    loss_mask = torch.tensor([[1.0, 1.0, 0.0]] * 8)
    rank_step = loss_mat.shape[0] // dp_size
    aggregate = BOUNDARIES[boundary]
    shards = (loss_mat.split(rank_step), loss_mask.split(rank_step))

    rank_losses = aggregate(*shards, mode="token-sum", grad_scale=dp_size)
    fsdp_reduced = torch.stack(rank_losses).mean()
    (global_sum,) = aggregate([loss_mat], [loss_mask], mode="token-sum")

    torch.testing.assert_close(fsdp_reduced, global_sum)
    # Negative control: without G the FSDP average is the global sum divided by dp_size.
    unscaled = torch.stack(aggregate(*shards, mode="token-sum")).mean()
    torch.testing.assert_close(unscaled * dp_size, global_sum)
    assert not torch.allclose(unscaled, global_sum)
