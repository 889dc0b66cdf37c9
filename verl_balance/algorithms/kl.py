"""Per-token KL estimators between the current policy and a reference policy.

Elementwise (any packed, sliced or padded layout; the loss contract masks padding). With
x = log p - log p_ref (Schulman 2020): k1 = x, k2 = x^2 / 2, abs = |x|,
low_var_kl = k3 = exp(-x) + x - 1 >= 0, clamped as verl (x to [-20, 20], result to [-10, 10]).
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("low_var_kl", "k1", "k2", "abs")
KL_ALIASES = {"k3": "low_var_kl", "kl": "k1", "mse": "k2"}


class KLEstimatorError(ValueError):
    """Unknown KL estimator name."""


def canonical_kl_type(kl_type: str) -> str:
    """Resolve verl's aliases (k3, kl, mse) to one of KL_ESTIMATORS; raise on unknown names."""
    name = KL_ALIASES.get(kl_type, kl_type)
    if name not in KL_ESTIMATORS:
        raise KLEstimatorError(
            f"kl_loss_type={kl_type!r} is not supported; valid: {sorted(KL_ESTIMATORS + tuple(KL_ALIASES))}"
        )
    return name


def kl_penalty(*, log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL(p || p_ref) estimate for tokens sampled from p; same shape as the inputs."""
    name = canonical_kl_type(kl_type)
    log_ratio = log_probs - ref_log_probs
    if name == "k1":
        return log_ratio
    if name == "k2":
        return 0.5 * log_ratio.square()
    if name == "abs":
        return log_ratio.abs()
    ref_log_ratio = torch.clamp(-log_ratio, min=-20.0, max=20.0)
    k3 = torch.exp(ref_log_ratio) - ref_log_ratio - 1.0
    return torch.clamp(k3, min=-10.0, max=10.0)
