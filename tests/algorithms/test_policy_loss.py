"""PPO-clip per-token loss against hand-worked clipping cases and a direct scalar reference."""

import math

import pytest
import torch

from verl_balance.algorithms import PolicyLossConfig, PolicyLossConfigError, kl_penalty, ppo_clip_token_loss


def _loss(ratio, adv, **config):
    ratio = torch.tensor(ratio, dtype=torch.float64)
    log_probs = ratio.log().requires_grad_(True)
    loss, metrics = ppo_clip_token_loss(
        log_probs=log_probs,
        old_log_probs=torch.zeros_like(log_probs),
        advantages=torch.tensor(adv, dtype=torch.float64),
        config=PolicyLossConfig(**config),
    )
    return loss, metrics, log_probs


# (ratio, advantage) -> (loss, clipped by the eps range, clipped by the dual bound), eps = 0.2, c = 3
HAND_CASES = [
    (1.5, 1.0, -1.2, 1.0, 0.0),  # A > 0, ratio above 1 + eps: clipped
    (0.5, 1.0, -0.5, 0.0, 0.0),  # A > 0, ratio below 1 - eps: pessimistic unclipped term wins
    (1.5, -1.0, 1.5, 0.0, 0.0),  # A < 0, ratio above 1 + eps: unclipped (pessimistic)
    (0.5, -1.0, 0.8, 1.0, 0.0),  # A < 0, ratio below 1 - eps: clipped
    (5.0, -1.0, 3.0, 0.0, 1.0),  # A < 0, ratio above c: dual clip bounds the loss at c * |A|
    (1.1, 2.0, -2.2, 0.0, 0.0),  # inside the trust region: plain -A * ratio
]


@pytest.mark.parametrize("ratio,adv,loss,clipfrac,clipfrac_lower", HAND_CASES)
def test_hand_worked_clipping_cases(ratio, adv, loss, clipfrac, clipfrac_lower):
    got, metrics, _ = _loss([ratio], [adv])
    assert got.item() == pytest.approx(loss)
    assert metrics["pg_clipfrac"].item() == clipfrac
    assert metrics["pg_clipfrac_lower"].item() == clipfrac_lower
    assert metrics["ppo_kl"].item() == pytest.approx(-math.log(ratio))


def test_clipped_tokens_get_no_gradient_and_others_get_minus_a_ratio():
    ratios, advs = [c[0] for c in HAND_CASES], [c[1] for c in HAND_CASES]
    loss, _, log_probs = _loss(ratios, advs)
    loss.sum().backward()
    expected = [0.0, -0.5, 1.5, 0.0, 0.0, -2.2]  # d(-A r)/d log r = -A r where unclipped
    torch.testing.assert_close(log_probs.grad, torch.tensor(expected, dtype=torch.float64))


def test_asymmetric_clip_range_and_disabled_dual_clip():
    loss, _, _ = _loss([1.5, 0.5], [1.0, -1.0], clip_ratio_low=0.1, clip_ratio_high=0.28)
    torch.testing.assert_close(loss, torch.tensor([-1.28, 0.9], dtype=torch.float64))
    loss, metrics, _ = _loss([5.0], [-1.0], clip_ratio_c=None)
    assert loss.item() == pytest.approx(5.0) and "pg_clipfrac_lower" not in metrics


def _reference_token_loss(log_p, old_log_p, adv, ref_log_p, entropy, cfg):
    """Textbook PPO objective, one token at a time: -min(rA, clip(r)A), dual clip max(., cA) for A < 0."""
    r = math.exp(log_p - old_log_p)
    objective = min(r * adv, min(max(r, 1 - cfg.clip_ratio_low_value), 1 + cfg.clip_ratio_high_value) * adv)
    if adv < 0:
        objective = max(objective, cfg.clip_ratio_c * adv)
    kl = math.exp(ref_log_p - log_p) - (ref_log_p - log_p) - 1
    return -objective + cfg.kl_loss_coef * kl - cfg.entropy_coeff * entropy


def test_matches_direct_scalar_computation_with_kl_and_entropy():
    gen = torch.Generator().manual_seed(0)
    shape = (4, 9)
    log_p = -torch.rand(shape, generator=gen, dtype=torch.float64) * 3
    old = log_p + 0.4 * torch.randn(shape, generator=gen, dtype=torch.float64)
    ref = log_p + 0.3 * torch.randn(shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(shape, generator=gen, dtype=torch.float64)
    entropy = torch.rand(shape, generator=gen, dtype=torch.float64)
    cfg = PolicyLossConfig(
        clip_ratio=0.2,
        clip_ratio_high=0.28,
        use_kl_loss=True,
        kl_loss_coef=0.05,
        kl_loss_type="low_var_kl",
        entropy_coeff=0.01,
    )
    loss, metrics = ppo_clip_token_loss(
        log_probs=log_p, old_log_probs=old, advantages=adv, config=cfg, ref_log_probs=ref, entropy=entropy
    )
    expected = torch.tensor(
        [
            [
                _reference_token_loss(*(t[i, j].item() for t in (log_p, old, adv, ref, entropy)), cfg)
                for j in range(shape[1])
            ]
            for i in range(shape[0])
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(metrics["kl_loss"], kl_penalty(log_probs=log_p, ref_log_probs=ref, kl_type="k3"))
    torch.testing.assert_close(metrics["entropy"], entropy)
    assert 0 < metrics["pg_clipfrac"].mean() < 1  # the random case exercises both branches


def test_entropy_is_reported_without_entering_the_loss_when_coeff_is_zero():
    log_p = torch.tensor([-1.0, -2.0])
    loss_without, _ = ppo_clip_token_loss(
        log_probs=log_p, old_log_probs=log_p, advantages=torch.ones(2), config=PolicyLossConfig()
    )
    loss_with, metrics = ppo_clip_token_loss(
        log_probs=log_p,
        old_log_probs=log_p,
        advantages=torch.ones(2),
        config=PolicyLossConfig(),
        entropy=torch.tensor([5.0, 6.0]),
    )
    assert torch.equal(loss_without, loss_with) and torch.equal(metrics["entropy"], torch.tensor([5.0, 6.0]))


def test_config_errors_name_the_key():
    with pytest.raises(PolicyLossConfigError, match="clip_ratio_c"):
        PolicyLossConfig(clip_ratio_c=0.5)
    with pytest.raises(PolicyLossConfigError, match="clip_ratio_low"):
        PolicyLossConfig(clip_ratio_low=1.5)
    with pytest.raises(ValueError, match="kl_loss_type"):
        PolicyLossConfig(use_kl_loss=True, kl_loss_type="bogus")
    with pytest.raises(PolicyLossConfigError, match="ref_log_probs"):
        ppo_clip_token_loss(
            log_probs=torch.zeros(1),
            old_log_probs=torch.zeros(1),
            advantages=torch.zeros(1),
            config=PolicyLossConfig(use_kl_loss=True),
        )
    with pytest.raises(PolicyLossConfigError, match="entropy"):
        ppo_clip_token_loss(
            log_probs=torch.zeros(1),
            old_log_probs=torch.zeros(1),
            advantages=torch.zeros(1),
            config=PolicyLossConfig(entropy_coeff=0.01),
        )
