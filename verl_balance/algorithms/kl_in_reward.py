"""verl's KL penalty in the reward (``algorithm.use_kl_in_reward``) and its coefficient controllers.

Invariants (verl's ``apply_kl_penalty`` and ``core_algos.{Fixed,Adaptive}KLController``):
- token_level_rewards = token_level_scores - beta * kl * m, beta the controller's value *before*
  this step's update.
- ``value`` is driver state that trainers checkpoint.
- The penalty changes the rewards on the driver's whole batch, never the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from verl_balance.algorithms.kl import KL_ALIASES, KL_ESTIMATORS, canonical_kl_type, kl_penalty

KL_CTRL_TYPES = ("fixed", "adaptive")
REWARD_KL_METRIC = "actor/reward_kl_penalty"
REWARD_KL_COEF_METRIC = "actor/reward_kl_penalty_coeff"


@dataclass
class KLController:
    """The in-reward KL coefficient: ``value``; adaptive when ``target_kl`` and ``horizon`` are set."""

    value: float
    target_kl: float | None = None
    horizon: int | None = None

    def update(self, *, current_kl: float, n_steps: int) -> None:
        """verl's AdaptiveKLController.update (a no-op for the fixed controller)."""
        if self.horizon is None:
            return
        proportional_error = float(np.clip(current_kl / self.target_kl - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon


def build_kl_controller(*, type: str, kl_coef: float, target_kl: float, horizon: int) -> KLController:
    """verl's ``get_kl_controller`` for ``algorithm.kl_ctrl``; ValueError naming the key on a bad value."""
    if type not in KL_CTRL_TYPES:
        raise ValueError(f"algorithm.kl_ctrl.type={type!r}; valid: {list(KL_CTRL_TYPES)}")
    if type == "fixed":
        return KLController(value=float(kl_coef))
    if not horizon > 0 or not target_kl > 0:
        raise ValueError(
            f"algorithm.kl_ctrl.type=adaptive needs horizon > 0 and target_kl > 0 (got horizon={horizon}, "
            f"target_kl={target_kl})"
        )
    return KLController(value=float(kl_coef), target_kl=float(target_kl), horizon=int(horizon))


def in_reward_kl_type(name: str) -> str:
    """``algorithm.kl_penalty`` -> one of kl.KL_ESTIMATORS (``k3+`` is ``k3``: rewards carry no gradient)."""
    try:
        return canonical_kl_type(name[:-1] if name.endswith("+") else name)
    except ValueError:
        valid = sorted(KL_ESTIMATORS + tuple(KL_ALIASES))
        raise ValueError(f"kl_penalty={name!r} is not supported; valid: {valid} (each with an optional '+')") from None


def apply_kl_in_reward(
    *,
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    controller: KLController,
    kl_type: str,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(token_level_rewards, verl's two metrics); updates ``controller`` as verl does."""
    mask = response_mask.to(old_log_probs.dtype)
    kld = kl_penalty(log_probs=old_log_probs, ref_log_probs=ref_log_probs, kl_type=in_reward_kl_type(kl_type)) * mask
    beta = controller.value
    rewards = token_level_scores - beta * kld
    current_kl = float(((kld * mask).sum(-1) / (mask.sum(-1) + 1e-8)).mean())
    controller.update(current_kl=current_kl, n_steps=int(token_level_scores.shape[0]))
    return rewards, {REWARD_KL_METRIC: current_kl, REWARD_KL_COEF_METRIC: beta}


__all__ = [
    "KLController",
    "KL_CTRL_TYPES",
    "apply_kl_in_reward",
    "build_kl_controller",
    "in_reward_kl_type",
]
