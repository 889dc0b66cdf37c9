"""loss_counts + agg_loss: the global loss does not depend on how rows are split into DP ranks and
micro-batches. Reference: the contract weights applied to the whole batch at once. Negative
control: verl's own agg_loss with per-micro-batch (local) normalisation, as a legacy actor uses it.
Tolerance 1e-6: the weights come from the one weights function, ``loss.compute_token_weights``, in fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.integrations.verl import LossCounts, agg_loss, loss_counts
from verl_balance.loss import LossConfigError

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
SCALE = 16.0  # loss_scale_factor C of seq-mean-token-sum-norm


def _global_batch(seed, rows=12, width=16):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=gen)
    lengths[0] = 0  # a sequence without loss tokens
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    loss = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    return loss, mask


def _reference(loss, mask, mode) -> float:
    """The contract table on the whole mini-batch, written out independently."""
    n_i = mask.sum(-1)
    seqs = int((n_i > 0).sum())
    if mode == "token-mean":
        return float((loss * mask).sum() / mask.sum())
    if mode == "seq-mean-token-mean":
        per_seq = [(loss[i] * mask[i]).sum() / n_i[i] for i in range(len(n_i)) if n_i[i] > 0]
        return float(sum(per_seq) / seqs)
    total = float((loss * mask).sum() / seqs)
    return total / SCALE if mode == "seq-mean-token-sum-norm" else total


def _random_layout(rows, rng):
    """Random DP ranks x micro-batches (uneven sizes, possibly empty micro-batches)."""
    dp = int(rng.integers(1, 5))
    perm = rng.permutation(rows)
    ranks = np.array_split(perm, dp)
    return [np.split(r, np.sort(rng.integers(0, len(r) + 1, size=int(rng.integers(0, 4))))) for r in ranks]


@pytest.mark.parametrize("mode", MODES)
def test_summed_loss_equals_single_batch_reference_for_every_layout(mode):
    rng = np.random.default_rng(0)
    for seed in range(10):
        loss, mask = _global_batch(seed)
        layout = _random_layout(len(mask), rng)
        # all_reduce SUM over DP of each rank's local counts, simulated in one process
        per_rank = [loss_counts([mask[mb] for mb in rank]) for rank in layout]
        counts = LossCounts(sum(c.num_tokens for c in per_rank), sum(c.num_sequences for c in per_rank))
        total = sum(
            float(agg_loss(loss[mb], mask[mb], mode, counts=counts, loss_scale_factor=SCALE))
            for rank in layout
            for mb in rank
        )
        assert total == pytest.approx(_reference(loss, mask, mode), rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_verls_local_normalisation_is_layout_dependent_negative_control(mode):
    core_algos = pytest.importorskip(
        "verl.trainer.ppo.core_algos",
        reason=VERL_SKIP_REASON,
    )
    verl_agg_loss = core_algos.agg_loss

    loss, mask = _global_batch(seed=3)
    layout = [[np.arange(0, 2), np.arange(2, 6)], [np.arange(6, 12)]]
    dp = len(layout)
    # legacy actor: each micro-batch normalised locally, divided by grad-accumulation steps, DP-averaged
    verl_logged = sum(float(verl_agg_loss(loss[mb], mask[mb], mode)) / len(rank) for rank in layout for mb in rank) / dp
    counts = loss_counts([mask[mb] for rank in layout for mb in rank])
    ours = sum(float(agg_loss(loss[mb], mask[mb], mode, counts=counts)) for rank in layout for mb in rank)
    reference = _reference(loss, mask, mode)
    assert ours == pytest.approx(reference, rel=1e-6)
    assert abs(verl_logged - reference) > 1e-3 * abs(reference)


def test_grad_scale_times_fsdp_average_gives_the_gradient_of_the_global_loss():
    loss, mask = _global_batch(seed=5)
    layout = [[np.arange(0, 5)], [np.arange(5, 9), np.arange(9, 12)]]
    dp = len(layout)
    counts = loss_counts(mask)
    leaf = loss.clone().requires_grad_(True)
    rank_grads = []
    for rank in layout:
        leaf.grad = None
        sum(agg_loss(leaf[mb], mask[mb], "seq-mean-token-mean", counts=counts, grad_scale=dp) for mb in rank).backward()
        rank_grads.append(leaf.grad.clone())
    fsdp_average = sum(rank_grads) / dp
    reference = leaf.detach().clone().requires_grad_(True)
    n_i = mask.sum(-1, keepdim=True).clamp(min=1)
    ((reference * mask / n_i).sum() / counts.num_sequences).backward()
    torch.testing.assert_close(fsdp_average, reference.grad, rtol=1e-6, atol=1e-12)


def test_zero_loss_tokens_give_zero_not_nan():
    loss = torch.randn(3, 4)
    counts = loss_counts(torch.zeros(3, 4))
    assert counts == LossCounts(0, 0)
    for mode in MODES:
        value = agg_loss(loss, torch.zeros(3, 4), mode, counts=counts, loss_scale_factor=SCALE)
        assert float(value) == 0.0


def test_unknown_mode_and_missing_scale_are_rejected():
    with pytest.raises(LossConfigError, match="loss_agg_mode"):
        agg_loss(torch.zeros(1, 2), torch.ones(1, 2), "token-sum-mean", counts=LossCounts(2, 1))
    with pytest.raises(LossConfigError, match="loss_scale_factor"):
        agg_loss(torch.zeros(1, 2), torch.ones(1, 2), "seq-mean-token-sum-norm", counts=LossCounts(2, 1))
