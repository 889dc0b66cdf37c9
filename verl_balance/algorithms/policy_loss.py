"""PPO-clip policy loss (with optional dual clip, KL-to-reference and entropy bonus), per token.

Invariants:
- Elementwise over tokens, no reduction: the result is the same on any (dp, sp) layout,
  micro-batching or padding.
- r = exp(clamp(log_prob - old_log_prob, -20, 20)) (verl's ``vanilla``):
      pg = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
      if A < 0 and clip_ratio_c is set: pg = min(pg, -A clip_ratio_c)     (dual clip)
      loss = pg * w + kl_loss_coef * kl(log_prob, ref_log_prob) - entropy_coeff * entropy
  with w the rollout IS weight (``rollout_is_weights``, else 1).
- ``PPOLoss(on_policy=True)``: old_log_prob is the forward's own ``log_prob.detach()``, so ratio == 1
  exactly and loss and gradient equal a separate old-log-prob pass bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_balance.algorithms.kl import canonical_kl_type, kl_penalty
from verl_balance.batch_keys import (
    ADVANTAGES_KEY,
    LOSS_MASK_KEY,
    OLD_LOG_PROBS_KEY,
    REF_LOG_PROB_KEY,
    ROLLOUT_IS_WEIGHTS_KEY,
    ROLLOUT_LOG_PROBS_KEY,
)


class PolicyLossConfigError(ValueError):
    """Invalid policy-loss configuration or missing input tensor."""


@dataclass
class PolicyLossConfig:
    """verl's ``actor_rollout_ref.actor`` loss keys; the GRPO recipe's actor section extends this class."""

    clip_ratio: float = 0.2
    """Clip range of the probability ratio: [1 - low, 1 + high], both default to this."""
    clip_ratio_low: float | None = None
    """Lower clip range (null = clip_ratio); must be < 1."""
    clip_ratio_high: float | None = None
    """Upper clip range (null = clip_ratio; DAPO's clip-higher sets it larger)."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip bound for negative advantages, > 1 (null disables dual clip)."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(policy || reference) to the per-token loss (needs the reference policy)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL term."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: one of algorithms.kl.KL_ESTIMATORS or verl's aliases k3, kl, mse."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""

    def __post_init__(self):
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            if value is not None and not value >= 0:
                raise PolicyLossConfigError(f"{key}={value} must be >= 0 (or None to inherit clip_ratio)")
        if self.clip_ratio_low_value >= 1:
            raise PolicyLossConfigError(f"clip_ratio_low={self.clip_ratio_low_value} must be < 1 so 1 - low > 0")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise PolicyLossConfigError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (or None to disable dual clip)")
        if self.use_kl_loss:
            self.kl_loss_type = canonical_kl_type(self.kl_loss_type)

    @property
    def clip_ratio_low_value(self) -> float:
        """Effective lower clip range (clip_ratio_low, else clip_ratio)."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_ratio_high_value(self) -> float:
        """Effective upper clip range (clip_ratio_high, else clip_ratio)."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss itself needs per-token entropy (entropy_coeff != 0)."""
        return self.entropy_coeff != 0


def check_regularizer_inputs(
    *, config: PolicyLossConfig, ref_log_probs: torch.Tensor | None, entropy: torch.Tensor | None
) -> None:
    """Raise when the KL term lacks the reference log-probs or the entropy bonus the entropy."""
    if config.use_kl_loss and ref_log_probs is None:
        raise PolicyLossConfigError("use_kl_loss=True needs ref_log_probs (compute them with the reference policy)")
    if config.needs_entropy and entropy is None:
        raise PolicyLossConfigError(f"entropy_coeff={config.entropy_coeff} needs the per-token entropy")


def add_regularizers(
    pg: torch.Tensor,
    metrics: dict[str, torch.Tensor],
    *,
    log_probs: torch.Tensor,
    config: PolicyLossConfig,
    ref_log_probs: torch.Tensor | None,
    entropy: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg + kl_loss_coef * kl - entropy_coeff * entropy per token, adding the ``kl_loss`` and ``entropy`` metrics."""
    loss = pg
    if config.use_kl_loss:
        kl = kl_penalty(log_probs=log_probs, ref_log_probs=ref_log_probs, kl_type=config.kl_loss_type)
        metrics["kl_loss"] = kl.detach()
        loss = loss + config.kl_loss_coef * kl
    if entropy is not None:
        metrics["entropy"] = entropy.detach()
        if config.needs_entropy:
            loss = loss - config.entropy_coeff * entropy
    return loss, metrics


def ppo_clip_token_loss(
    *,
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    config: PolicyLossConfig,
    ref_log_probs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO-clip loss (same shape as ``log_probs``) and per-token detached metrics."""
    check_regularizer_inputs(config=config, ref_log_probs=ref_log_probs, entropy=entropy)

    log_ratio = torch.clamp(log_probs - old_log_probs, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.clip_ratio_low_value, 1 + config.clip_ratio_high_value)
    pg = torch.maximum(unclipped, clipped)
    metrics = {"pg_clipfrac": (clipped > unclipped).float()}
    if config.clip_ratio_c is not None:
        dual_bound = -advantages * config.clip_ratio_c
        negative = advantages < 0
        metrics["pg_clipfrac_lower"] = ((pg > dual_bound) & negative).float()
        pg = torch.where(negative, torch.minimum(pg, dual_bound), pg)
    if rollout_is_weights is not None:
        pg = pg * rollout_is_weights
    metrics["pg_loss"] = pg.detach()
    metrics["ppo_kl"] = (-log_ratio).detach()

    return add_regularizers(
        pg, metrics, log_probs=log_probs, config=config, ref_log_probs=ref_log_probs, entropy=entropy
    )


class PPOLoss:
    """The PPO-clip ``LossFn`` over ``old_log_probs``, ``advantages`` (and ``ref_log_prob`` with use_kl_loss)."""

    def __init__(self, config: PolicyLossConfig, *, report_entropy: bool = True, on_policy: bool = False):
        """``report_entropy``: entropy even when entropy_coeff == 0. ``on_policy``: old log-probs are this
        forward's own, detached."""
        self.config = config
        self.needs_entropy = config.needs_entropy or report_entropy
        self.on_policy = on_policy
        self.rollout_probs_diff_max: torch.Tensor | None = None

    def required_keys(self) -> tuple[str, ...]:
        """Per-token wire tensors every micro-batch must carry."""
        keys = (ADVANTAGES_KEY,) if self.on_policy else (OLD_LOG_PROBS_KEY, ADVANTAGES_KEY)
        return keys + ((REF_LOG_PROB_KEY,) if self.config.use_kl_loss else ())

    def __call__(
        self, *, log_probs: torch.Tensor, entropy: torch.Tensor | None, inputs, sequence_sum=None, batch_selection=None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss [T_local] and metrics of one micro-batch slice (reductions: loss_modes.ModeLoss)."""
        missing = [k for k in self.required_keys() if k not in inputs]
        if missing:
            raise PolicyLossConfigError(f"micro-batch lacks {missing} needed by the PPO loss; it has {sorted(inputs)}")
        if self.on_policy and OLD_LOG_PROBS_KEY in inputs:
            raise PolicyLossConfigError(
                f"on_policy=True takes the old log-probs from the update forward, but the micro-batch carries "
                f"{OLD_LOG_PROBS_KEY!r}; send one or the other"
            )
        old_log_probs = self.old_log_probs(log_probs, inputs)
        loss, metrics = self.token_loss(
            log_probs=log_probs,
            old_log_probs=old_log_probs,
            advantages=inputs[ADVANTAGES_KEY].to(log_probs.dtype),
            ref_log_probs=inputs[REF_LOG_PROB_KEY].to(log_probs.dtype) if self.config.use_kl_loss else None,
            entropy=entropy,
            inputs=inputs,
            sequence_sum=sequence_sum,
            batch_selection=batch_selection,
            rollout_is_weights=(
                inputs[ROLLOUT_IS_WEIGHTS_KEY].to(log_probs.dtype) if ROLLOUT_IS_WEIGHTS_KEY in inputs else None
            ),
        )
        if self.on_policy and ROLLOUT_LOG_PROBS_KEY in inputs:
            metrics["rollout_probs_diff_mean"] = self._rollout_probs_diff(log_probs, inputs)
        return loss, metrics

    def old_log_probs(self, log_probs: torch.Tensor, inputs) -> torch.Tensor:
        """The PPO ratio's denominator: this forward's own (detached) when on-policy, else the wire's."""
        if self.on_policy:
            return log_probs.detach()
        return inputs[OLD_LOG_PROBS_KEY].to(log_probs.dtype)

    def token_loss(
        self,
        *,
        log_probs,
        old_log_probs,
        advantages,
        ref_log_probs,
        entropy,
        inputs,
        sequence_sum,
        rollout_is_weights,
        batch_selection=None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token loss of verl's ``vanilla`` mode (a seam: loss_modes.ModeLoss runs the others)."""
        return ppo_clip_token_loss(
            log_probs=log_probs,
            old_log_probs=old_log_probs,
            advantages=advantages,
            config=self.config,
            ref_log_probs=ref_log_probs,
            entropy=entropy,
            rollout_is_weights=rollout_is_weights,
        )

    def _rollout_probs_diff(self, log_probs: torch.Tensor, inputs) -> torch.Tensor:
        """|p_rollout - p_trainer| per token, updating the running loss-mask maximum."""
        rollout = inputs[ROLLOUT_LOG_PROBS_KEY].to(log_probs.dtype)
        diff = (rollout.exp() - log_probs.detach().exp()).abs()
        if diff.numel():
            local = torch.where(inputs[LOSS_MASK_KEY] > 0, diff, 0.0).max()  # no device sync
            previous = self.rollout_probs_diff_max
            self.rollout_probs_diff_max = local if previous is None else torch.maximum(previous, local)
        return diff
