"""verl's policy-loss modes whose per-token loss depends on that token's inputs only.

Each returns (pg, metrics) per token, unreduced, so it is layout-invariant as it stands.
x = log_prob - old_log_prob, r = exp(clamp(x, -20, 20)), A the advantage, [lo, hi] the clip range:

- vanilla: ``policy_loss.ppo_clip_token_loss``; gpg: pg = -A * log_prob.
- dppo_tv / dppo_kl: pg = -A * sg(min(r, c)) * log_prob * valid (trust-region validity per token).
- sapo: pg = -A * sigmoid(tau (r - 1)) * 4 / tau (aggregated seq-mean-token-mean).
- dro: pg = -(A * log_prob - beta / 2 * x^2), ``policy_loss.dro_beta`` > 0 required.
- cispo: pg = -sg(clip(r, 1 - lo, 1 + hi)) * A * log_prob.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from verl_balance.algorithms.policy_loss import PolicyLossConfig, PolicyLossConfigError, ppo_clip_token_loss

LOG_RATIO_CLAMP = 20.0
"""verl clamps the log-ratio to [-20, 20] before exp in most modes."""


def clamped_log_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    """x = clamp(log_prob - old_log_prob, -20, 20)."""
    return torch.clamp(log_probs - old_log_probs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


def vanilla(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """PPO-clip (``ppo_clip_token_loss`` without its KL and entropy terms, added by the caller)."""
    pg_only = replace(config, use_kl_loss=False, entropy_coeff=0.0)
    return ppo_clip_token_loss(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, config=pg_only)


def _dppo(log_probs, old_log_probs, advantages, config: PolicyLossConfig, valid: Tensor):
    x = clamped_log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(x)
    cap = config.clip_ratio_c
    truncated = ratio if cap is None else torch.clamp(ratio, max=cap)
    valid = valid.detach().to(log_probs.dtype)
    pg = -advantages * truncated.detach() * log_probs * valid
    over = torch.zeros_like(valid) if cap is None else (ratio > cap).to(valid.dtype)
    return pg, {
        "pg_clipfrac": (1.0 - valid).detach(),
        "pg_clipfrac_lower": (over * valid).detach(),
        "ppo_kl": (-x).detach(),
    }


def dppo_tv(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """DPPO with a total-variation trust region on the sampled token's probability."""
    delta = torch.exp(log_probs) - torch.exp(old_log_probs)
    valid = torch.where(advantages > 0, delta <= config.clip_ratio_high_value, delta >= -config.clip_ratio_low_value)
    return _dppo(log_probs, old_log_probs, advantages, config, valid)


def dppo_kl(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """DPPO with a binary-KL trust region on the sampled token's probability."""
    prob, old_prob = torch.exp(log_probs), torch.exp(old_log_probs)
    binary_kl = old_prob * (old_log_probs - log_probs) + (1 - old_prob) * torch.log(
        (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
    )
    up = (binary_kl <= config.clip_ratio_high_value) | (prob <= old_prob)
    down = (binary_kl <= config.clip_ratio_low_value) | (prob >= old_prob)
    return _dppo(log_probs, old_log_probs, advantages, config, torch.where(advantages > 0, up, down))


def sapo(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """Soft-gated policy optimisation: a sigmoid gate on the ratio instead of a hard clip."""
    x = clamped_log_ratio(log_probs, old_log_probs)
    tau = torch.where(
        advantages > 0,
        torch.as_tensor(mode.tau_pos, dtype=advantages.dtype, device=advantages.device),
        torch.as_tensor(mode.tau_neg, dtype=advantages.dtype, device=advantages.device),
    )
    gate = torch.sigmoid(tau * (torch.exp(x) - 1.0)) * (4.0 / tau)
    zeros = torch.zeros_like(x).detach()
    return -gate * advantages, {"pg_clipfrac": zeros, "pg_clipfrac_lower": zeros, "ppo_kl": (-x).detach()}


def gpg(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """Plain policy gradient -A * log_prob (GPG)."""
    return -log_probs * advantages, {}


def dro(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """Direct reward optimisation: policy gradient with a quadratic log-ratio penalty."""
    beta = mode.dro_beta
    if beta is None or not beta > 0:
        raise PolicyLossConfigError(f"policy_loss.dro_beta={beta!r}: loss_mode='dro' needs a positive value")
    x = log_probs - old_log_probs
    return -(log_probs * advantages - 0.5 * beta * x.square()), {"ppo_kl": (-x).detach()}


def cispo(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """Clipped importance-sampling policy optimisation: the clipped ratio is a constant weight."""
    x = clamped_log_ratio(log_probs, old_log_probs)
    ratio = torch.exp(x)
    clipped = torch.clamp(ratio, 1 - config.clip_ratio_low_value, 1 + config.clip_ratio_high_value)
    pg = -clipped.detach() * advantages * log_probs
    return pg, {
        "pg_clipfrac": (ratio != clipped).to(log_probs.dtype).detach(),
        "pg_clipfrac_lower": torch.zeros_like(x).detach(),
        "ppo_kl": (-x).detach(),
    }
