"""The policy-loss mode registry: verl's ``actor.policy_loss.loss_mode`` names, each a per-token loss
under the loss contract, with the reductions the engine must supply and its aggregation.

Invariants:
- ``policy_token_loss`` returns per-token loss and detached metrics, unreduced.
- ``LOSS_MODE_REGISTRY[name].reductions`` names what the mode reads from ``reduced``; modes without
  reductions are exact on any SP slice as they stand.
- ``agg_mode``: sapo and geo_mean aggregate seq-mean-token-mean whatever ``loss_agg_mode`` says.
- With one micro-batch holding the mini-batch, J equals verl's function of the same name, value and
  gradient (tests/algorithms).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from verl_balance.algorithms import global_loss_modes as glob
from verl_balance.algorithms import rollout_correction as rc
from verl_balance.algorithms import token_loss_modes as tok
from verl_balance.algorithms.batch_selection import covariance_selections, sequence_fingerprint_terms, token_hash_keys
from verl_balance.algorithms.policy_loss import (
    PolicyLossConfig,
    PolicyLossConfigError,
    PPOLoss,
    add_regularizers,
    check_regularizer_inputs,
)
from verl_balance.batch_keys import ADVANTAGES_KEY, INPUT_IDS_KEY, LOSS_MASK_KEY, POSITION_IDS_KEY

LOSS_MODE_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"


@dataclass(frozen=True)
class LossModeSpec:
    """One registry entry."""

    fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    reductions: tuple[str, ...] = ()
    """Keys of ``reduced`` the mode reads (beyond those its settings add, see ``required_reductions``)."""
    agg_mode: str | None = None
    """The aggregation verl forces for this mode (None = ``loss_agg_mode``)."""
    applies_is_weights: bool = True
    """Multiply the per-token pg by ``rollout_is_weights`` (geo_mean and bypass_mode weight otherwise)."""


LOSS_MODE_REGISTRY: dict[str, LossModeSpec] = {
    "vanilla": LossModeSpec(tok.vanilla),
    "gspo": LossModeSpec(glob.gspo, ("seq_mean_log_ratio",)),
    "sapo": LossModeSpec(tok.sapo, agg_mode=SEQ_MEAN_TOKEN_MEAN),
    "gpg": LossModeSpec(tok.gpg),
    "clip_cov": LossModeSpec(glob.clip_cov, ("clip_cov_drop",)),
    "kl_cov": LossModeSpec(glob.kl_cov, ("kl_cov_select",)),
    "geo_mean": LossModeSpec(
        glob.geo_mean,
        ("seq_mean_clipped_log_ratio", "seq_mean_advantage"),
        agg_mode=SEQ_MEAN_TOKEN_MEAN,
        applies_is_weights=False,
    ),
    "dro": LossModeSpec(tok.dro),
    "cispo": LossModeSpec(tok.cispo),
    "dppo_tv": LossModeSpec(tok.dppo_tv),
    "dppo_kl": LossModeSpec(tok.dppo_kl),
    "bypass_mode": LossModeSpec(rc.bypass_mode, applies_is_weights=False),
}
"""verl's 12 policy-loss modes."""


@dataclass
class LossModeKeys:
    """verl's ``actor.policy_loss.*`` keys with verl's defaults (the GRPO recipe's section extends it)."""

    loss_mode: str = "vanilla"
    """One of LOSS_MODE_REGISTRY."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of the mini-batch's tokens to drop."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower covariance bound of a candidate."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper covariance bound of a candidate."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of the mini-batch's tokens that get the KL penalty."""
    ppo_kl_coef: float = 0.1
    """kl_cov: weight of |log-ratio| on the selected tokens."""
    dro_beta: float | None = None
    """dro: weight of the quadratic log-ratio penalty (required, > 0)."""
    rollout_correction: rc.RolloutCorrectionConfig = field(default_factory=rc.RolloutCorrectionConfig)
    """bypass_mode's loss type, IS weights and rejection (verl's ``policy_loss.rollout_correction``)."""


@dataclass
class LossModeConfig(LossModeKeys):
    """``LossModeKeys`` plus SAPO's ``tau_pos`` / ``tau_neg``; clip range and dual clip: ``PolicyLossConfig``."""

    tau_pos: float = 1.0
    """sapo: gate temperature for positive advantages (verl's ``actor.tau_pos``)."""
    tau_neg: float = 1.05
    """sapo: gate temperature for non-positive advantages (verl's ``actor.tau_neg``)."""

    def __post_init__(self):
        if self.loss_mode not in LOSS_MODE_REGISTRY:
            raise PolicyLossConfigError(f"{LOSS_MODE_KEY}={self.loss_mode!r}; valid: {sorted(LOSS_MODE_REGISTRY)}")
        for key in ("clip_cov_ratio", "kl_cov_ratio", "tau_pos", "tau_neg"):
            if not getattr(self, key) > 0:
                raise PolicyLossConfigError(f"policy_loss.{key}={getattr(self, key)!r} must be > 0")
        if not self.clip_cov_lb < self.clip_cov_ub:
            raise PolicyLossConfigError(
                f"policy_loss.clip_cov_lb={self.clip_cov_lb} must be < policy_loss.clip_cov_ub={self.clip_cov_ub}"
            )
        if self.loss_mode == "dro" and not (self.dro_beta is not None and self.dro_beta > 0):
            raise PolicyLossConfigError(f"policy_loss.dro_beta={self.dro_beta!r}: loss_mode='dro' needs a value > 0")


def required_reductions(mode: LossModeConfig, *, with_is_weights: bool = False) -> tuple[str, ...]:
    """Every key of ``reduced`` this configuration reads."""
    keys = LOSS_MODE_REGISTRY[mode.loss_mode].reductions
    if mode.loss_mode == "geo_mean" and with_is_weights:
        keys += ("seq_is_weight",)
    if mode.loss_mode == "bypass_mode":
        corr = mode.rollout_correction
        if corr.loss_type == "reinforce" and corr.rollout_is is not None:
            keys += ("bypass_is_weights",)
        if corr.rollout_rs is not None:
            keys += ("bypass_keep_mask",)
    return keys


def policy_token_loss(
    *,
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    config: PolicyLossConfig,
    mode: LossModeConfig,
    reduced: Mapping[str, Tensor] | None = None,
    ref_log_probs: Tensor | None = None,
    entropy: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token loss of ``mode.loss_mode`` (same shape as ``log_probs``) and per-token detached metrics."""
    reduced = dict(reduced or {})
    missing = [k for k in required_reductions(mode, with_is_weights=rollout_is_weights is not None) if k not in reduced]
    if missing:
        raise PolicyLossConfigError(
            f"{LOSS_MODE_KEY}={mode.loss_mode!r} needs the reduced quantities {missing} (see "
            f"algorithms/global_loss_modes.py); got {sorted(reduced)}"
        )
    check_regularizer_inputs(config=config, ref_log_probs=ref_log_probs, entropy=entropy)
    spec = LOSS_MODE_REGISTRY[mode.loss_mode]
    pg, metrics = spec.fn(
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        config=config,
        mode=mode,
        reduced=reduced,
    )
    if rollout_is_weights is not None and spec.applies_is_weights:
        pg = pg * rollout_is_weights
    metrics = {**metrics, "pg_loss": pg.detach()}
    return add_regularizers(
        pg, metrics, log_probs=log_probs, config=config, ref_log_probs=ref_log_probs, entropy=entropy
    )


SEQUENCE_REDUCED_MODES = ("gspo", "geo_mean")
"""Modes whose reductions are per-sequence means, exact on any layout via the engine's ``sequence_sum``."""


def sequence_reductions(
    *,
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    config,
    mode,
    sequence_sum,
    rollout_is_weights: Tensor | None = None,
) -> dict[str, Tensor]:
    """gspo's / geo_mean's ``reduced`` on one SP slice (``reference_reductions`` over ``sequence_sum``)."""
    mask = loss_mask.to(log_probs.dtype)
    count = sequence_sum(mask)
    if mode.loss_mode == "gspo":
        x = (log_probs - old_log_probs).detach()
        return {"seq_mean_log_ratio": sequence_sum(x * mask) / count.clamp(min=1)}
    x_clip, _ = glob.geo_mean_clipped_log_ratio(
        log_probs=log_probs.detach(), old_log_probs=old_log_probs, advantages=advantages, config=config
    )
    out = {
        "seq_mean_clipped_log_ratio": sequence_sum(x_clip * mask) / (count + glob.MEAN_EPS),
        "seq_mean_advantage": sequence_sum(advantages * mask) / (count + glob.MEAN_EPS),
    }
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights + 1e-10)
        out["seq_is_weight"] = torch.exp(sequence_sum(log_w * mask) / (count + glob.MEAN_EPS))
    return out


BATCH_SELECTED_MODES = ("clip_cov", "kl_cov")
"""Modes whose reductions are mini-batch token selections (batch_selection.py), from a no-grad forward."""


class ModeLoss(PPOLoss):
    """``PPOLoss`` with verl's ``policy_loss.loss_mode``, the same on any (dp, sp) layout and micro-batching."""

    def __init__(self, config: PolicyLossConfig, *, mode: LossModeConfig, **kwargs):
        super().__init__(config, **kwargs)
        self.mode = mode
        reductions = required_reductions(mode)
        bypass = mode.loss_mode == "bypass_mode"
        normalize = mode.rollout_correction.rollout_is_batch_normalize
        self.normalizes_is_weights = "bypass_is_weights" in reductions and normalize
        self.needs_sequence_sums = mode.loss_mode in SEQUENCE_REDUCED_MODES or (bypass and bool(reductions))
        self.needs_batch_selection = mode.loss_mode in BATCH_SELECTED_MODES or self.normalizes_is_weights

    def batch_selections(
        self, *, log_probs, inputs, sequence_sums, seed: int, num_tokens: int, world_sum, world_gather
    ) -> list[dict[str, Tensor]]:
        """Per micro-batch, its part of clip_cov's / kl_cov's mini-batch selection, or bypass_mode's mean terms."""
        if self.normalizes_is_weights:
            return self._is_mean_terms(
                log_probs=log_probs, inputs=inputs, sequence_sums=sequence_sums, world_sum=world_sum
            )

        def hash_keys(i: int) -> Tensor:
            positions = inputs[i][POSITION_IDS_KEY]
            terms = sequence_fingerprint_terms(inputs[i][INPUT_IDS_KEY], positions)
            return token_hash_keys(sequence_sums[i](terms), positions, seed=seed)

        return covariance_selections(
            log_probs=log_probs,
            old_log_probs=[self.old_log_probs(lp, x) for lp, x in zip(log_probs, inputs)],
            advantages=[x[ADVANTAGES_KEY].to(lp.dtype) for lp, x in zip(log_probs, inputs)],
            loss_masks=[x[LOSS_MASK_KEY].to(lp.dtype) for lp, x in zip(log_probs, inputs)],
            hash_keys=hash_keys,
            num_tokens=num_tokens,
            config=self.config,
            mode=self.mode,
            world_sum=world_sum,
            world_gather=world_gather,
        )

    def _is_mean_terms(self, *, log_probs, inputs, sequence_sums, world_sum) -> list[dict[str, Tensor]]:
        """bypass_mode's batch-normalisation: the world SUM of every local slice's is_batch_mean_terms."""
        corr = self.mode.rollout_correction
        terms = torch.zeros(2, dtype=torch.float64)
        for lp, x, seq_sum in zip(log_probs, inputs, sequence_sums):
            mask = x[LOSS_MASK_KEY].to(lp.dtype)
            log_ratio = lp.detach() - self.old_log_probs(lp, x)
            weights = rc.is_weights(log_ratio=log_ratio, loss_mask=mask, config=corr, sequence_sum=seq_sum)
            terms += rc.is_batch_mean_terms(weights, mask, corr, seq_sum).cpu()
        world_sum(terms)
        return [{"bypass_is_mean_terms": terms} for _ in log_probs]

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
    ):
        reduced = {}
        if self.mode.loss_mode == "bypass_mode":
            missing_sums = self.needs_sequence_sums and sequence_sum is None
            if missing_sums or (self.normalizes_is_weights and not batch_selection):
                raise PolicyLossConfigError(
                    f"{LOSS_MODE_KEY}='bypass_mode' with {self.mode.rollout_correction} needs the engine's "
                    "sequence_sum and (rollout_is_batch_normalize) its mini-batch-wide batch_selection"
                )
            reduced = rc.bypass_reductions(
                log_probs=log_probs,
                old_log_probs=old_log_probs,
                loss_mask=inputs[LOSS_MASK_KEY],
                config=self.mode.rollout_correction,
                sequence_sum=sequence_sum,
                is_mean_terms=(batch_selection or {}).get("bypass_is_mean_terms"),
            )
        elif self.needs_sequence_sums:
            if sequence_sum is None:
                raise PolicyLossConfigError(f"{LOSS_MODE_KEY}={self.mode.loss_mode!r} needs the engine's sequence_sum")
            reduced = sequence_reductions(
                log_probs=log_probs,
                old_log_probs=old_log_probs,
                advantages=advantages,
                loss_mask=inputs[LOSS_MASK_KEY],
                config=self.config,
                mode=self.mode,
                sequence_sum=sequence_sum,
                rollout_is_weights=rollout_is_weights,
            )
        if self.needs_batch_selection and self.mode.loss_mode != "bypass_mode":
            if batch_selection is None:
                raise PolicyLossConfigError(
                    f"{LOSS_MODE_KEY}={self.mode.loss_mode!r} needs the engine's mini-batch-wide batch_selection"
                )
            reduced = dict(batch_selection)
        return policy_token_loss(
            log_probs=log_probs,
            old_log_probs=old_log_probs,
            advantages=advantages,
            config=self.config,
            mode=self.mode,
            reduced=reduced,
            ref_log_probs=ref_log_probs,
            entropy=entropy,
            rollout_is_weights=rollout_is_weights,
        )


def build_policy_loss(
    config: PolicyLossConfig, *, mode: LossModeConfig | None = None, on_policy: bool = False
) -> PPOLoss:
    """The actor's loss function: ``PPOLoss`` for vanilla (or no mode), ``ModeLoss`` for the others."""
    if mode is None or mode.loss_mode == "vanilla":
        return PPOLoss(config, on_policy=on_policy)
    return ModeLoss(config, mode=mode, on_policy=on_policy)
