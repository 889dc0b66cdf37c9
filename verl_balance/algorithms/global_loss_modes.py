"""verl's policy-loss modes whose per-token loss needs a quantity reduced over a whole sequence or
the whole mini-batch, and the reductions the engine must supply.

Each function takes its reduced quantities in ``reduced`` (per token, aligned with ``log_probs``,
detached), so the loss stays per token under the loss contract; ``reference_reductions`` is the
single-process reference. x = log_prob - old_log_prob, m the loss mask, n_i = sum of m over
sequence i, N the contract's token count:

- ``seq_mean_log_ratio`` (gspo): s_i = sum_t(x m) / max(n_i, 1), summed over the SP group.
- ``seq_mean_clipped_log_ratio``, ``seq_mean_advantage`` (geo_mean): mu_i = sum_t(x' m) / (n_i + 1e-8),
  A_i = sum_t(A m) / (n_i + 1e-8).
- ``clip_cov_drop`` (clip_cov), ``kl_cov_select`` (kl_cov): token selections by covariance over the
  mini-batch (batch_selection.py); they equal verl's with one micro-batch holding the mini-batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_balance.algorithms.policy_loss import PolicyLossConfig

GSPO_LOG_RATIO_MAX = 10.0
"""verl clamps GSPO's token log-ratio from above at 10."""
MEAN_EPS = 1e-8
"""verl's masked_mean epsilon (geo_mean's sequence means)."""


def gspo(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """Sequence-level ratio (detached, from ``seq_mean_log_ratio``) with a per-token gradient."""
    x = log_probs - old_log_probs
    log_ratio = torch.clamp(log_probs - log_probs.detach() + reduced["seq_mean_log_ratio"], max=GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.clip_ratio_low_value, 1 + config.clip_ratio_high_value)
    return torch.maximum(unclipped, clipped), {
        "pg_clipfrac": (clipped > unclipped).to(x.dtype).detach(),
        "pg_clipfrac_lower": torch.zeros_like(x).detach(),
        "ppo_kl": (-x).detach(),
    }


def geo_mean_clipped_log_ratio(
    *, log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, config: PolicyLossConfig
) -> tuple[Tensor, Tensor]:
    """(x', clipped): GMPO's sign-aware token clip of x = log_prob - old_log_prob, and where it clipped."""
    x = log_probs - old_log_probs
    clamped = torch.clamp(x, -config.clip_ratio_low_value, config.clip_ratio_high_value)
    sign = torch.sign(advantages)
    return sign * torch.minimum(sign * x, sign * clamped), x != clamped


def geo_mean(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """GMPO's geometric-mean ratio per sequence as a per-token surrogate (module docstring)."""
    x_clip, clipped = geo_mean_clipped_log_ratio(
        log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, config=config
    )
    seq_value = -reduced["seq_mean_advantage"] * torch.exp(reduced["seq_mean_clipped_log_ratio"])
    if "seq_is_weight" in reduced:
        seq_value = seq_value * reduced["seq_is_weight"]
    pg = seq_value * (1.0 + x_clip - x_clip.detach())
    dtype = log_probs.dtype
    return pg, {
        "pg_clipfrac": (clipped & (advantages > 0)).to(dtype),
        "pg_clipfrac_lower": (clipped & (advantages < 0)).to(dtype),
        "ppo_kl": (old_log_probs - log_probs).detach(),
    }


def _ppo_terms(log_probs, old_log_probs, advantages, config: PolicyLossConfig):
    ratio = torch.exp(log_probs - old_log_probs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.clip_ratio_low_value, 1 + config.clip_ratio_high_value)
    return ratio, unclipped, clipped


def clip_cov(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """PPO-clip with the batch-wide selected high-covariance tokens dropped (``clip_cov_drop``)."""
    _, unclipped, clipped = _ppo_terms(log_probs, old_log_probs, advantages, config)
    drop = reduced["clip_cov_drop"].to(log_probs.dtype)
    pg = torch.maximum(unclipped, clipped) * (1.0 - drop)
    return pg, {"pg_clipfrac": drop.detach(), "ppo_kl": (old_log_probs - log_probs).detach()}


def kl_cov(*, log_probs, old_log_probs, advantages, config: PolicyLossConfig, mode, reduced):
    """-A r, plus ppo_kl_coef * |x| on the batch-wide top-k covariance tokens (``kl_cov_select``)."""
    _, unclipped, _ = _ppo_terms(log_probs, old_log_probs, advantages, config)
    abs_kl = (log_probs - old_log_probs).abs()
    pg = torch.where(reduced["kl_cov_select"] > 0, unclipped + mode.ppo_kl_coef * abs_kl, unclipped)
    return pg, {"ppo_kl": abs_kl.detach()}


def token_covariance(
    *, advantages: Tensor, log_probs: Tensor, loss_mask: Tensor, mean_advantage: float, mean_log_prob: float
) -> Tensor:
    """cov = (A - mean_A)(log_prob - mean_lp) per token (detached), given the mini-batch's global means."""
    cov = (advantages.detach() - mean_advantage) * (log_probs.detach() - mean_log_prob)
    return torch.where(loss_mask > 0, cov, torch.zeros_like(cov))


def clip_cov_candidates(
    *, cov: Tensor, log_probs, old_log_probs, advantages, loss_mask: Tensor, config: PolicyLossConfig, mode
) -> Tensor:
    """Tokens clip_cov may drop: in the loss mask, not clipped by PPO, clip_cov_lb < cov < clip_cov_ub."""
    _, unclipped, clipped = _ppo_terms(log_probs.detach(), old_log_probs, advantages, config)
    return (loss_mask > 0) & ~(clipped > unclipped) & (cov > mode.clip_cov_lb) & (cov < mode.clip_cov_ub)
