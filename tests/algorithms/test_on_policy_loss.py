"""PPOLoss(on_policy=True): old log-probs = the forward's own, detached.

Reference: the same loss fed old log-probs from a separate pass whose values equal the forward's
bit for bit (a detached clone), i.e. what the old-log-prob pass gives when its forward is
identical. Value, metrics and gradient must match exactly. Negative controls: old log-probs that
are the forward's own but NOT detached (ratio 1, gradient 0) and old log-probs one step away are
detected by the same comparison.
"""

import pytest
import torch

from verl_balance.algorithms import PolicyLossConfig, PolicyLossConfigError, PPOLoss

CONFIG = PolicyLossConfig(clip_ratio=0.2, clip_ratio_high=0.28, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
TOKENS, VOCAB = 64, 11


def _inputs(seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(TOKENS, VOCAB, generator=gen, dtype=torch.float32)
    advantages = torch.randn(TOKENS, generator=gen)
    advantages[::7] = 0.0  # ties of the dual clip at A = 0
    inputs = {
        "targets": torch.randint(0, VOCAB, (TOKENS,), generator=gen),
        "loss_mask": (torch.rand(TOKENS, generator=gen) > 0.2).long(),
        "advantages": advantages,
        "ref_log_prob": -torch.rand(TOKENS, generator=gen) * 3,
        "rollout_log_probs": -torch.rand(TOKENS, generator=gen) * 3,
    }
    return logits, inputs


def _loss_and_grad(loss_fn: PPOLoss, logits: torch.Tensor, inputs: dict, *, old=None):
    """Per-token loss, metrics and d(sum of masked loss)/d logits; ``old(log_probs)`` builds the
    old log-probs the separate pass would send (None: the micro-batch carries none)."""
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1)
    log_probs = logp.gather(-1, inputs["targets"][:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    inputs = dict(inputs)
    if old is not None:
        inputs["old_log_probs"] = old(log_probs)
    loss, metrics = loss_fn(log_probs=log_probs, entropy=entropy, inputs=inputs)
    (loss * inputs["loss_mask"]).sum().backward()
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, logits.grad


def test_on_policy_loss_value_metrics_and_gradient_equal_a_bitwise_equal_old_pass():
    logits, inputs = _inputs()
    loss, metrics, grad = _loss_and_grad(PPOLoss(CONFIG, on_policy=True), logits, inputs)
    ref_loss, ref_metrics, ref_grad = _loss_and_grad(
        PPOLoss(CONFIG), logits, inputs, old=lambda lp: lp.detach().clone()
    )
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grad, ref_grad)
    for name in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss", "entropy"):
        assert torch.equal(metrics[name], ref_metrics[name]), name
    assert not metrics["pg_clipfrac"].any() and not metrics["pg_clipfrac_lower"].any()
    assert not metrics["ppo_kl"].any()
    assert grad.abs().sum() > 0


@pytest.mark.parametrize(
    "bad_old",
    [
        pytest.param(lambda lp: lp, id="not-detached"),  # ratio 1 but no policy gradient
        pytest.param(lambda lp: lp.detach() - 0.05, id="one-step-stale"),
    ],
)
def test_negative_control_old_log_probs_that_are_not_the_detached_forward_are_detected(bad_old):
    logits, inputs = _inputs()
    loss, _, grad = _loss_and_grad(PPOLoss(CONFIG, on_policy=True), logits, inputs)
    bad_loss, _, bad_grad = _loss_and_grad(PPOLoss(CONFIG), logits, inputs, old=bad_old)
    assert not (torch.equal(loss, bad_loss) and torch.allclose(grad, bad_grad, rtol=1e-3, atol=1e-6))


def test_on_policy_rollout_gap_is_the_per_token_probability_gap_and_a_masked_running_max():
    loss_fn = PPOLoss(CONFIG, on_policy=True)
    expected_max = 0.0
    for seed in range(3):
        logits, inputs = _inputs(seed)
        inputs["rollout_log_probs"][inputs["loss_mask"] == 0] = 0.0  # p = 1: the largest gaps, all masked
        _, metrics, _ = _loss_and_grad(loss_fn, logits, inputs)
        log_probs = torch.log_softmax(logits, -1).gather(-1, inputs["targets"][:, None]).squeeze(-1)
        gap = (inputs["rollout_log_probs"].exp() - log_probs.exp()).abs()
        torch.testing.assert_close(metrics["rollout_probs_diff_mean"], gap, rtol=0, atol=1e-7)
        expected_max = max(expected_max, float(gap[inputs["loss_mask"] > 0].max()))
        assert float(loss_fn.rollout_probs_diff_max) == pytest.approx(expected_max, abs=1e-7)
        # a masked token's gap would have been the max
        assert float(gap.max()) > float(gap[inputs["loss_mask"] > 0].max()) + 0.01
    off_policy = PPOLoss(CONFIG)
    _, metrics, _ = _loss_and_grad(off_policy, logits, inputs, old=lambda lp: lp.detach().clone())
    assert "rollout_probs_diff_mean" not in metrics and off_policy.rollout_probs_diff_max is None


def test_on_policy_loss_rejects_old_log_probs_and_requires_advantages():
    logits, inputs = _inputs()
    with pytest.raises(PolicyLossConfigError, match="old_log_probs"):
        _loss_and_grad(PPOLoss(CONFIG, on_policy=True), logits, inputs, old=lambda lp: lp.detach())
    del inputs["advantages"]
    with pytest.raises(PolicyLossConfigError, match="advantages"):
        _loss_and_grad(PPOLoss(CONFIG, on_policy=True), logits, inputs)
    assert PPOLoss(CONFIG, on_policy=True).required_keys() == ("advantages", "ref_log_prob")
    assert PPOLoss(CONFIG).required_keys() == ("old_log_probs", "advantages", "ref_log_prob")
