"""The policy-loss modes without verl: hand-worked values and gradients, independent references,
the SP-shard reductions, token-sum weights, and errors that name the key
(tests/algorithms/test_loss_modes_verl.py compares each mode with verl's own)."""

from __future__ import annotations

import math

import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.algorithms.global_loss_modes import geo_mean_clipped_log_ratio
from verl_balance.algorithms.loss_modes import (
    LOSS_MODE_REGISTRY,
    LossModeConfig,
    policy_token_loss,
    required_reductions,
)
from verl_balance.algorithms.loss_reductions import reference_reductions
from verl_balance.algorithms.policy_loss import PolicyLossConfig, PolicyLossConfigError
from verl_balance.algorithms.rollout_correction import RolloutCorrectionConfig, is_weights, keep_mask
from verl_balance.loss import compute_token_weights

VERL_MODES = {
    "vanilla",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "dppo_tv",
    "dppo_kl",
    "bypass_mode",
}
CONFIG = PolicyLossConfig(clip_ratio=0.2, clip_ratio_high=0.28)


def loss_and_grad(name, log_probs, old, adv, *, reduced=None, **mode_kwargs):
    lp = torch.as_tensor(log_probs, dtype=torch.float64).clone().requires_grad_(True)
    loss, metrics = policy_token_loss(
        log_probs=lp,
        old_log_probs=torch.as_tensor(old, dtype=torch.float64),
        advantages=torch.as_tensor(adv, dtype=torch.float64),
        config=CONFIG,
        mode=LossModeConfig(loss_mode=name, **mode_kwargs),
        reduced=reduced,
    )
    loss.sum().backward()
    return loss.detach(), lp.grad, metrics


def test_registry_holds_verls_modes():
    assert set(LOSS_MODE_REGISTRY) == VERL_MODES
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason=VERL_SKIP_REASON)
    assert set(core_algos.POLICY_LOSS_REGISTRY) == VERL_MODES


def test_config_errors_name_the_key():
    with pytest.raises(PolicyLossConfigError, match=r"policy_loss\.loss_mode='ppo'.*valid"):
        LossModeConfig(loss_mode="ppo")
    with pytest.raises(PolicyLossConfigError, match=r"policy_loss\.dro_beta=None"):
        LossModeConfig(loss_mode="dro")
    with pytest.raises(PolicyLossConfigError, match=r"clip_cov_lb=5.0 must be < policy_loss\.clip_cov_ub=1.0"):
        LossModeConfig(loss_mode="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0)
    with pytest.raises(PolicyLossConfigError, match=r"rollout_correction\.rollout_rs=.*token_k9"):
        RolloutCorrectionConfig(rollout_rs="token_k9", rollout_rs_threshold=2.0)
    with pytest.raises(PolicyLossConfigError, match=r"rollout_rs_threshold is required"):
        RolloutCorrectionConfig(rollout_rs="token_k2")
    with pytest.raises(PolicyLossConfigError, match="token_k2 takes one upper bound"):
        RolloutCorrectionConfig(rollout_rs="token_k2", rollout_rs_threshold="0.5_2")


@pytest.mark.parametrize("name", ["gspo", "geo_mean", "clip_cov", "kl_cov"])
def test_missing_reductions_fail_naming_the_mode(name):
    with pytest.raises(PolicyLossConfigError, match=rf"loss_mode='{name}' needs the reduced quantities"):
        loss_and_grad(name, [-1.0], [-1.0], [1.0])


def test_gpg_is_the_plain_policy_gradient():
    loss, grad, _ = loss_and_grad("gpg", [-0.5, -2.0], [-1.0, -1.0], [2.0, -1.0])
    torch.testing.assert_close(loss, torch.tensor([1.0, -2.0], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([-2.0, 1.0], dtype=torch.float64))


def test_dro_adds_a_quadratic_penalty_on_the_log_ratio():
    loss, grad, _ = loss_and_grad("dro", [-1.0 + math.log(2)], [-1.0], [3.0], dro_beta=0.5)
    x = math.log(2)
    assert loss.item() == pytest.approx(-(3.0 * (-1.0 + x) - 0.25 * x * x))
    assert grad.item() == pytest.approx(-3.0 + 0.5 * x)


def test_cispo_weights_the_log_prob_gradient_by_the_clipped_ratio():
    # ratio 2 > 1 + 0.28: the weight is 1.28, a constant (stop-gradient), so d loss / d log_prob = -1.28 A.
    _, grad, metrics = loss_and_grad("cispo", [-1.0 + math.log(2)], [-1.0], [1.5])
    assert grad.item() == pytest.approx(-1.28 * 1.5)
    assert metrics["pg_clipfrac"].item() == 1.0


def test_sapo_at_ratio_one():
    # gate(1) = sigmoid(0) * 4 / tau = 2 / tau; its slope there is tau / 4 * 4 / tau = 1: gradient -A.
    loss, grad, _ = loss_and_grad("sapo", [-1.0, -1.0], [-1.0, -1.0], [2.0, -2.0], tau_pos=1.0, tau_neg=2.0)
    torch.testing.assert_close(loss, torch.tensor([-4.0, 2.0], dtype=torch.float64))
    torch.testing.assert_close(grad, torch.tensor([-2.0, 2.0], dtype=torch.float64))


def test_dppo_tv_masks_tokens_whose_probability_moved_too_far():
    # p_old = 0.5; p = 0.6 moves +0.1 (inside 0.28), p = 0.9 moves +0.4 (outside): only the first trains.
    lp = [math.log(0.6), math.log(0.9)]
    loss, grad, metrics = loss_and_grad("dppo_tv", lp, [math.log(0.5)] * 2, [1.0, 1.0])
    assert grad[0].item() == pytest.approx(-0.6 / 0.5) and grad[1].item() == 0.0
    torch.testing.assert_close(metrics["pg_clipfrac"], torch.tensor([0.0, 1.0], dtype=torch.float64))


def test_gspo_with_a_constant_token_ratio_is_ppo_clip_without_dual_clip():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=gen, dtype=torch.float64)
    shift = torch.tensor([[0.1], [-0.3], [0.02], [0.5]], dtype=torch.float64)
    adv = torch.randn(4, 1, generator=gen, dtype=torch.float64).expand(4, 5)
    mask = torch.ones(4, 5, dtype=torch.float64)
    reduced = reference_reductions(
        log_probs=old + shift,
        old_log_probs=old,
        advantages=adv,
        loss_mask=mask,
        config=CONFIG,
        mode=LossModeConfig("gspo"),
    )
    gspo = loss_and_grad("gspo", old + shift, old, adv, reduced=reduced)
    lp = (old + shift).clone().requires_grad_(True)
    no_dual = PolicyLossConfig(clip_ratio=0.2, clip_ratio_high=0.28, clip_ratio_c=None)
    ppo, _ = policy_token_loss(
        log_probs=lp, old_log_probs=old, advantages=adv, config=no_dual, mode=LossModeConfig("vanilla")
    )
    ppo.sum().backward()
    torch.testing.assert_close(gspo[0], ppo.detach())
    torch.testing.assert_close(gspo[1], lp.grad)


def _batch(seed, rows=5, width=8):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    old = -torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2
    lp = old + 0.3 * torch.randn(rows, width, generator=gen, dtype=torch.float64)
    adv = torch.randn(rows, 1, generator=gen, dtype=torch.float64).expand(rows, width).contiguous()
    return mask, old, lp, adv


def _objective(name, lp, old, adv, mask, reduced, agg="seq-mean-token-mean"):
    rows, width = mask.shape
    loss, _ = policy_token_loss(
        log_probs=lp, old_log_probs=old, advantages=adv, config=CONFIG, mode=LossModeConfig(name), reduced=reduced
    )
    w = compute_token_weights(
        loss_masks=[mask.flatten()], cu_seqlens=[torch.arange(rows + 1) * width], agg_mode=agg, dp_group=None
    ).weights[0]
    return (w.view(rows, width).double() * loss).sum()


def test_geo_mean_surrogate_equals_the_per_sequence_gmpo_loss():
    """Independent reference: GMPO's loss written per sequence, -mean_i(A_i exp(mean_t x'_it))."""
    mask, old, lp0, adv = _batch(1)
    lp = lp0.clone().requires_grad_(True)
    reduced = reference_reductions(
        log_probs=lp, old_log_probs=old, advantages=adv, loss_mask=mask, config=CONFIG, mode=LossModeConfig("geo_mean")
    )
    ours = _objective("geo_mean", lp, old, adv, mask, reduced)
    ours.backward()
    ref_lp = lp0.clone().requires_grad_(True)
    x_clip, _ = geo_mean_clipped_log_ratio(log_probs=ref_lp, old_log_probs=old, advantages=adv, config=CONFIG)
    n = mask.sum(-1)
    ref = -((adv * mask).sum(-1) / n * torch.exp((x_clip * mask).sum(-1) / n)).mean()
    ref.backward()
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(lp.grad, ref_lp.grad, rtol=1e-6, atol=1e-10)


@pytest.mark.parametrize("name", ["gspo", "geo_mean"])
def test_sequence_reductions_from_sp_shards_equal_the_whole_batch(name):
    """Two SP ranks each hold half of every sequence's tokens: per-sequence partial sums, summed over the
    two (the SP all-reduce), then each rank's per-token loss on its half: J and its gradient equal the
    whole batch's."""
    mask, old, lp0, adv = _batch(2)
    mode = LossModeConfig(name)
    whole_lp = lp0.clone().requires_grad_(True)
    whole = reference_reductions(
        log_probs=whole_lp, old_log_probs=old, advantages=adv, loss_mask=mask, config=CONFIG, mode=mode
    )
    expected = _objective(name, whole_lp, old, adv, mask, whole)
    expected.backward()

    lp = lp0.clone().requires_grad_(True)
    halves = [slice(0, 3), slice(3, None)]
    x = (lp - old).detach()
    if name == "geo_mean":
        x, _ = geo_mean_clipped_log_ratio(log_probs=lp.detach(), old_log_probs=old, advantages=adv, config=CONFIG)
    partial = [(x[:, h] * mask[:, h]).sum(-1) for h in halves]  # each rank's local per-sequence sums
    adv_partial = [(adv[:, h] * mask[:, h]).sum(-1) for h in halves]
    n = mask.sum(-1)  # full-sequence counts: the contract's n_i
    if name == "gspo":
        reduced = {"seq_mean_log_ratio": (sum(partial) / n)[:, None].expand_as(x)}
    else:
        reduced = {
            "seq_mean_clipped_log_ratio": (sum(partial) / (n + 1e-8))[:, None].expand_as(x),
            "seq_mean_advantage": (sum(adv_partial) / (n + 1e-8))[:, None].expand_as(x),
        }
    rows, width = mask.shape
    w = (
        compute_token_weights(
            loss_masks=[mask.flatten()],
            cu_seqlens=[torch.arange(rows + 1) * width],
            agg_mode="seq-mean-token-mean",
            dp_group=None,
        )
        .weights[0]
        .view(rows, width)
        .double()
    )
    total = 0
    for h in halves:
        loss, _ = policy_token_loss(
            log_probs=lp[:, h],
            old_log_probs=old[:, h],
            advantages=adv[:, h],
            config=CONFIG,
            mode=mode,
            reduced={k: v[:, h] for k, v in reduced.items()},
        )
        total = total + (w[:, h] * loss).sum()
    total.backward()
    torch.testing.assert_close(total.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp.grad, whole_lp.grad, rtol=1e-12, atol=1e-12)


def test_clip_cov_drops_and_kl_cov_penalises_only_the_selected_tokens():
    mask, old, lp, adv = _batch(3)
    selected = torch.zeros_like(mask)
    selected[0, 0] = selected[2, 1] = 1.0
    drop, _, _ = loss_and_grad("clip_cov", lp, old, adv, reduced={"clip_cov_drop": selected})
    keep_all, _, _ = loss_and_grad("clip_cov", lp, old, adv, reduced={"clip_cov_drop": torch.zeros_like(mask)})
    assert (drop[selected > 0] == 0).all() and torch.equal(drop[selected == 0], keep_all[selected == 0])
    kl, _, _ = loss_and_grad("kl_cov", lp, old, adv, reduced={"kl_cov_select": selected}, ppo_kl_coef=0.5)
    plain, _, _ = loss_and_grad("kl_cov", lp, old, adv, reduced={"kl_cov_select": torch.zeros_like(mask)})
    torch.testing.assert_close(kl - plain, 0.5 * (lp - old).abs() * selected)


def test_kl_cov_selects_the_top_covariance_tokens():
    mask = torch.ones(1, 4, dtype=torch.float64)
    adv = torch.tensor([[2.0, 1.0, -1.0, -2.0]], dtype=torch.float64)
    # means 0 and -1.25: cov = A (lp + 1.25) = [1.5, 0.25, 0.25, 1.5], largest at tokens 0 and 3
    lp = torch.tensor([[-0.5, -1.0, -1.5, -2.0]], dtype=torch.float64)
    reduced = reference_reductions(
        log_probs=lp,
        old_log_probs=lp,
        advantages=adv,
        loss_mask=mask,
        config=CONFIG,
        mode=LossModeConfig("kl_cov", kl_cov_ratio=0.5),
    )
    torch.testing.assert_close(reduced["kl_cov_select"], torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64))


def test_bypass_mode_reductions_follow_the_settings():
    assert required_reductions(LossModeConfig("bypass_mode")) == ()
    no_weights = RolloutCorrectionConfig(loss_type="reinforce")  # verl's YAML default: rollout_is null
    assert required_reductions(LossModeConfig("bypass_mode", rollout_correction=no_weights)) == ()
    reinforce = RolloutCorrectionConfig(
        loss_type="reinforce", rollout_is="token", rollout_rs="seq_max_k2", rollout_rs_threshold=0.1
    )
    assert required_reductions(LossModeConfig("bypass_mode", rollout_correction=reinforce)) == (
        "bypass_is_weights",
        "bypass_keep_mask",
    )


def test_is_weights_truncate_or_icepop():
    lr = torch.log(torch.tensor([[0.5, 1.0, 3.0]], dtype=torch.float64))
    mask = torch.ones_like(lr)
    tis = is_weights(log_ratio=lr, loss_mask=mask, config=RolloutCorrectionConfig("token", 2.0))
    torch.testing.assert_close(tis, torch.tensor([[0.5, 1.0, 2.0]], dtype=torch.float64))
    icepop = is_weights(log_ratio=lr, loss_mask=mask, config=RolloutCorrectionConfig("token", "0.8_2"))
    torch.testing.assert_close(icepop, torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64))
    seq = is_weights(
        log_ratio=lr,
        loss_mask=mask,
        config=RolloutCorrectionConfig("sequence", 5.0),
    )
    torch.testing.assert_close(seq, torch.full_like(lr, 1.5))


def test_token_k1_rejection_keeps_ratios_inside_the_bounds():
    lr = torch.log(torch.tensor([[0.5, 1.0, 1.1, 3.0]], dtype=torch.float64))
    config = RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.8_1.25")
    keep = keep_mask(log_ratio=lr, loss_mask=torch.ones_like(lr), config=config)
    # k1 = -log r must lie in [log 0.8, log 1.25]: r in [0.8, 1.25].
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1.0, 1.0, 0.0]], dtype=torch.float64))


def test_token_sum_weights_are_the_mask_on_any_dp_split():
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    whole = compute_token_weights(
        loss_masks=[mask], cu_seqlens=[torch.tensor([0, 3, 6])], agg_mode="token-sum", dp_group=None
    )
    assert torch.equal(whole.weights[0], mask) and whole.num_tokens == 4
    halves = compute_token_weights(
        loss_masks=[mask[:3], mask[3:]],
        cu_seqlens=[torch.tensor([0, 3]), torch.tensor([0, 3])],
        agg_mode="token-sum",
        dp_group=None,
    )
    assert torch.equal(torch.cat(halves.weights), mask)


def test_kl_and_entropy_terms_are_added_per_token_for_every_mode():
    from verl_balance.algorithms.kl import kl_penalty
    from verl_balance.algorithms.policy_loss import ppo_clip_token_loss

    mask, old, lp, adv = _batch(4)
    ref = old - 0.2
    entropy = torch.rand_like(lp)
    config = PolicyLossConfig(use_kl_loss=True, kl_loss_coef=0.3, entropy_coeff=0.05)
    kwargs = dict(log_probs=lp, old_log_probs=old, advantages=adv, ref_log_probs=ref, entropy=entropy, config=config)
    vanilla, metrics = policy_token_loss(mode=LossModeConfig("vanilla"), **kwargs)
    expected, _ = ppo_clip_token_loss(**kwargs)
    torch.testing.assert_close(vanilla, expected)
    gpg, _ = policy_token_loss(mode=LossModeConfig("gpg"), **kwargs)
    kl = kl_penalty(log_probs=lp, ref_log_probs=ref, kl_type="low_var_kl")
    torch.testing.assert_close(gpg, -adv * lp + 0.3 * kl - 0.05 * entropy)
    assert set(metrics) >= {"pg_loss", "kl_loss", "entropy", "ppo_kl", "pg_clipfrac"}
    with pytest.raises(PolicyLossConfigError, match="use_kl_loss=True needs ref_log_probs"):
        policy_token_loss(mode=LossModeConfig("gpg"), **{**kwargs, "ref_log_probs": None})
