"""verl's CPU tests of the critic's value-loss normalisation, run against our value loss and loss contract.

Adapts ``tests/trainer/ppo/test_value_loss_normalization_on_cpu.py`` of verl-project/verl at commit
1dda039b9c6311889a9c9a26040677e1254814f9 (the file as last changed in 2eb020aa). verl passes the
mini-batch's normalisers (``batch_num_tokens``, ``global_batch_size``, ``dp_size``) into
``compute_value_loss`` per micro-batch; in their place we run what our critic engine runs: the
per-token ``algorithms.value_loss.ValueLoss`` and the weights of ``loss.compute_token_weights``,
taken once over the mini-batch's micro-batches (rows = sequences), each rank back-propagating
G * sum(w * l). Several DP ranks are one weights call over all their micro-batches (what the DP
all-reduce SUM of the counts gives). verl's ``loss_scale_factor=None`` falls back to the padded
width; ours needs the constant, so the cases pass that width (10).

The reported ``vf_loss`` is, in our engine, the SUM of the micro-batches' sum(w * l) over the
mini-batch (the all-reduce SUM of loss.py), which stands in for verl's ``Metric(SUM)`` reduction.
Cases: 26 upstream (the cuda one only where a GPU is visible), all adapted, all pass.
"""

from __future__ import annotations

import pytest
import torch

from verl_balance.algorithms.value_loss import ValueLoss
from verl_balance.batch_keys import RETURNS_KEY, VALUES_KEY
from verl_balance.loss import compute_token_weights

_CLIP = 0.5
_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
_WIDTH_C = 10.0  # verl's default C for seq-mean-token-sum-norm: the padded response width of these cases


def _make_value_batch(batch_size, resp_len, seed=0, lengths=None):
    g = torch.Generator().manual_seed(seed)
    vpreds = torch.randn(batch_size, resp_len, generator=g)
    values = torch.randn(batch_size, resp_len, generator=g)
    returns = torch.randn(batch_size, resp_len, generator=g)
    if lengths is None:
        response_mask = torch.ones(batch_size, resp_len)
    else:
        response_mask = torch.zeros(batch_size, resp_len)
        for i, length in enumerate(lengths):
            response_mask[i, :length] = 1.0
    return vpreds, values, returns, response_mask


def _token_loss(vpreds, values, returns):
    """Our ValueLoss on (b, L) rows: per-token loss and per-token metrics."""
    return ValueLoss(cliprange_value=_CLIP)(values=vpreds, inputs={VALUES_KEY: values, RETURNS_KEY: returns})


def _micro_batch_losses(vpreds, values, returns, mask, num_micro_batches, *, mode, grad_scale=1.0, scope="mini"):
    """G * sum(w * l) of each micro-batch. ``scope="mini"``: one weights call over all micro-batches (the
    contract); ``"micro"``: one call per micro-batch, verl's normalisation without the global info."""
    step = mask.shape[0] // num_micro_batches
    parts = list(zip(*(t.split(step) for t in (vpreds, values, returns, mask))))
    masks = [p[3].reshape(-1) for p in parts]
    cu = [torch.arange(p[3].shape[0] + 1) * p[3].shape[1] for p in parts]
    kwargs = {"agg_mode": mode, "loss_scale_factor": _WIDTH_C, "dp_group": None}
    if scope == "mini":
        weights = compute_token_weights(loss_masks=masks, cu_seqlens=cu, **kwargs).weights
    else:
        weights = [
            compute_token_weights(loss_masks=[m], cu_seqlens=[c], **kwargs).weights[0] for m, c in zip(masks, cu)
        ]
    losses = []
    for (vp, old, ret, _), w in zip(parts, weights):
        loss, _ = _token_loss(vp, old, ret)
        losses.append(grad_scale * (w.to(loss.dtype) * loss.reshape(-1)).sum())
    return losses


def _verl_table(vpreds, values, returns, mask, mode):
    """The whole mini-batch's value loss written out from verl's agg_loss formulas (rows all non-empty)."""
    clipped = values + (vpreds - values).clamp(-_CLIP, _CLIP)
    per_token = 0.5 * torch.maximum((vpreds - returns) ** 2, (clipped - returns) ** 2) * mask
    rows = mask.shape[0]
    if mode == "token-mean":
        return per_token.sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return (per_token.sum(-1) / mask.sum(-1)).sum() / rows
    total = per_token.sum() / rows
    return total / _WIDTH_C if mode == "seq-mean-token-sum-norm" else total


@pytest.mark.parametrize("mode", _MODES)
@pytest.mark.parametrize("num_micro_batches", [1, 2, 4])
def test_value_loss_microbatch_invariant_all_modes(mode, num_micro_batches):
    batch_size, resp_len = 8, 10
    vpreds, values, returns, mask = _make_value_batch(batch_size, resp_len)

    (whole,) = _micro_batch_losses(vpreds, values, returns, mask, 1, mode=mode)
    accum = sum(_micro_batch_losses(vpreds, values, returns, mask, num_micro_batches, mode=mode))

    torch.testing.assert_close(accum, whole)
    torch.testing.assert_close(whole, _verl_table(vpreds, values, returns, mask, mode))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("num_micro_batches", [2, 4])
def test_value_loss_microbatch_invariant_variable_length(mode, num_micro_batches):
    batch_size, resp_len = 8, 12
    lengths = [12, 7, 3, 11, 5, 9, 2, 6]
    vpreds, values, returns, mask = _make_value_batch(batch_size, resp_len, lengths=lengths)

    (whole,) = _micro_batch_losses(vpreds, values, returns, mask, 1, mode=mode)
    accum = sum(_micro_batch_losses(vpreds, values, returns, mask, num_micro_batches, mode=mode))

    torch.testing.assert_close(accum, whole)
    torch.testing.assert_close(whole, _verl_table(vpreds, values, returns, mask, mode))


@pytest.mark.parametrize("dp_size", [2, 4])
def test_value_loss_dp_size_matches_global_mean_after_fsdp_reduce(dp_size):
    """Each rank weighs by the global token count and back-propagates G times its sum; FSDP's mean over
    the ranks gives the whole mini-batch's token-mean."""
    batch_size, resp_len = 8, 10
    vpreds, values, returns, mask = _make_value_batch(batch_size, resp_len)

    (truth,) = _micro_batch_losses(vpreds, values, returns, mask, 1, mode="token-mean")
    rank_losses = _micro_batch_losses(vpreds, values, returns, mask, dp_size, mode="token-mean", grad_scale=dp_size)
    fsdp_reduced = torch.stack(rank_losses).mean()

    torch.testing.assert_close(fsdp_reduced, truth)
    # Negative control: each rank counting only its own tokens inflates the reduced loss by G.
    local = _micro_batch_losses(
        vpreds, values, returns, mask, dp_size, mode="token-mean", grad_scale=dp_size, scope="micro"
    )
    torch.testing.assert_close(torch.stack(local).mean(), dp_size * truth)


def test_vf_loss_metric_sum_aggregation_reports_global_mean():
    """The logged loss is the SUM of the micro-batches' contributions; their mean (a plain-float
    metric's reduction) would report a quarter of it here."""
    batch_size, resp_len, num_micro_batches = 8, 10, 4
    vpreds, values, returns, mask = _make_value_batch(batch_size, resp_len)

    (whole,) = _micro_batch_losses(vpreds, values, returns, mask, 1, mode="token-mean")
    parts = _micro_batch_losses(vpreds, values, returns, mask, num_micro_batches, mode="token-mean")
    logged = sum(float(p.detach().double()) for p in parts)

    assert logged == pytest.approx(whole.item(), rel=1e-5)
    assert sum(float(p) for p in parts) / num_micro_batches != pytest.approx(whole.item(), rel=1e-2)


def test_loss_scale_factor_is_forwarded():
    """seq-mean-token-sum-norm: halving C doubles the loss."""
    batch_size, resp_len = 8, 10
    vpreds, values, returns, mask = _make_value_batch(batch_size, resp_len)
    loss, _ = _token_loss(vpreds, values, returns)
    cu = [torch.arange(batch_size + 1) * resp_len]

    def aggregated(c):
        (w,) = compute_token_weights(
            loss_masks=[mask.reshape(-1)],
            cu_seqlens=cu,
            agg_mode="seq-mean-token-sum-norm",
            loss_scale_factor=c,
            dp_group=None,
        ).weights
        return (w * loss.reshape(-1)).sum()

    torch.testing.assert_close(aggregated(5.0), 2 * aggregated(10.0))


def test_vf_clipfrac_unaffected_by_normalization():
    """The clip fraction is a per-token metric of ValueLoss, reduced as a loss-mask token mean: the same
    for the whole batch and for 4 DP ranks' micro-batches, and equal to the masked mean written out."""
    batch_size, resp_len = 8, 10
    vpreds, values, returns, mask = _make_value_batch(batch_size, resp_len)

    _, metrics = _token_loss(vpreds, values, returns)
    clipfrac_local = (metrics["vf_clipfrac"] * mask).sum() / mask.sum()
    rank_sums = []
    for vp, old, ret, m in zip(*(t.split(2) for t in (vpreds, values, returns, mask))):
        _, rank_metrics = _token_loss(vp, old, ret)
        rank_sums.append((rank_metrics["vf_clipfrac"] * m).sum())
    clipfrac_global = torch.stack(rank_sums).sum() / mask.sum()

    torch.testing.assert_close(clipfrac_local, clipfrac_global)
    clipped = values + (vpreds - values).clamp(-_CLIP, _CLIP)
    by_hand = (((clipped - returns) ** 2 > (vpreds - returns) ** 2).float() * mask).sum() / mask.sum()
    torch.testing.assert_close(clipfrac_local, by_hand)


@pytest.mark.parametrize("num_micro_batches", [2, 4])
def test_value_loss_without_global_info_is_microbatch_dependent(num_micro_batches):
    """Negative control: weights taken per micro-batch (local counts) inflate the accumulated loss by the
    micro-batch count."""
    batch_size, resp_len = 8, 10
    vpreds, values, returns, mask = _make_value_batch(batch_size, resp_len)

    (whole,) = _micro_batch_losses(vpreds, values, returns, mask, 1, mode="token-mean")
    accum = sum(_micro_batch_losses(vpreds, values, returns, mask, num_micro_batches, mode="token-mean", scope="micro"))

    torch.testing.assert_close(accum, num_micro_batches * whole)
    assert not torch.allclose(accum, whole)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_value_loss_gradient_invariant_to_microbatch_split(device):
    """Real autograd (float64): the per-micro-batch backwards accumulate the whole mini-batch's gradient."""
    batch_size, resp_len, num_micro_batches = 8, 10, 4
    g = torch.Generator().manual_seed(0)
    base_vpreds = torch.randn(batch_size, resp_len, dtype=torch.float64, generator=g)
    values = torch.randn(batch_size, resp_len, dtype=torch.float64, generator=g).to(device)
    returns = torch.randn(batch_size, resp_len, dtype=torch.float64, generator=g).to(device)
    mask = torch.ones(batch_size, resp_len, dtype=torch.float64, device=device)

    whole_vpreds = base_vpreds.clone().to(device).requires_grad_(True)
    (whole_loss,) = _micro_batch_losses(whole_vpreds, values, returns, mask, 1, mode="token-mean")
    whole_loss.backward()

    accum_vpreds = base_vpreds.clone().to(device).requires_grad_(True)
    for loss_mb in _micro_batch_losses(accum_vpreds, values, returns, mask, num_micro_batches, mode="token-mean"):
        loss_mb.backward()

    torch.testing.assert_close(accum_vpreds.grad, whole_vpreds.grad)
    assert accum_vpreds.grad.abs().sum() > 0
