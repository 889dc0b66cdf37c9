"""Rollout correction for ``policy_loss.loss_mode=bypass_mode`` (verl's ``rollout_correction`` keys):
importance weights and rejection of tokens/sequences by the training-vs-rollout divergence.

With lr = log_prob (detached) - rollout_log_prob per token, lr clamped to +-20:
- IS weights (``rollout_is``): token exp(lr_t) or sequence exp(sum_t lr m), truncated (TIS) or zeroed
  outside [lower, upper] (IcePop); ``rollout_is_batch_normalize`` divides by the mini-batch mean.
- Rejection (``rollout_rs``, comma-separated, all must pass): k1 = -lr, k2 = lr^2 / 2,
  k3 = exp(lr) - 1 - lr, per token or per sequence (sum/mean/max).
- Rejected tokens get loss 0 but stay in the contract's counts (as verl's global token count).

Every per-sequence quantity is a SUM, so ``is_weights`` / ``keep_mask`` take a ``sequence_sum``
(``row_sum`` whole, the SP-group sum on a slice); the batch mean is the world SUM of
``is_batch_mean_terms``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from verl_balance.algorithms.policy_loss import PolicyLossConfigError
from verl_balance.algorithms.token_loss_modes import vanilla

SAFETY_BOUND = 20.0
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
KEY = "rollout_correction"
"""Errors name rollout_correction.<key>; the config loader prefixes the section that holds it."""
SequenceSum = Callable[[Tensor], Tensor]
"""Per-token values -> the sum over each token's full sequence, per token."""


def _floats(spec, key: str) -> tuple[float, float | None]:
    """(upper, lower or None) from a number, "u" or "lower_upper"."""
    text = str(spec).strip()
    try:
        parts = [float(p) for p in text.split("_", 1)]
    except ValueError:
        raise PolicyLossConfigError(f"{KEY}.{key}={spec!r} is not a number or 'lower_upper'") from None
    upper, lower = parts[-1], (parts[0] if len(parts) == 2 else None)
    if not upper > 0 or (lower is not None and not 0 < lower <= upper):
        raise PolicyLossConfigError(f"{KEY}.{key}={spec!r}: need 0 < lower <= upper")
    return upper, lower


@dataclass
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction`` keys with the defaults of verl's YAML."""

    rollout_is: str | None = None
    """IS weight level: token, sequence, or null (no weights)."""
    rollout_is_threshold: str | float = 2.0
    """TIS upper bound, or "lower_upper" for IcePop."""
    rollout_is_batch_normalize: bool = False
    """Divide the IS weights by their mini-batch mean."""
    rollout_rs: str | None = None
    """Rejection options, comma-separated (RS_OPTIONS), or null."""
    rollout_rs_threshold: str | float | None = None
    """One threshold per option (or one for all), comma-separated."""
    bypass_mode: bool = False
    """The trainer's switch: old_log_probs := rollout_log_probs and loss_mode := bypass_mode."""
    loss_type: str = "ppo_clip"
    """bypass_mode's loss: ppo_clip or reinforce."""

    def __post_init__(self):
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise PolicyLossConfigError(f"{KEY}.rollout_is={self.rollout_is!r}; valid: {IS_LEVELS} or null")
        if self.loss_type not in LOSS_TYPES:
            raise PolicyLossConfigError(f"{KEY}.loss_type={self.loss_type!r}; valid: {LOSS_TYPES}")
        _floats(self.rollout_is_threshold, "rollout_is_threshold")
        self.rs_thresholds()

    def rs_thresholds(self) -> dict[str, tuple[float, float]]:
        """option -> (low, high) bounds on its statistic (log-space for k1 options; low -inf otherwise)."""
        if self.rollout_rs is None:
            return {}
        options = list(dict.fromkeys(o.strip() for o in self.rollout_rs.split(",") if o.strip()))
        bad = [o for o in options if o not in RS_OPTIONS]
        if bad or not options:
            raise PolicyLossConfigError(f"{KEY}.rollout_rs={self.rollout_rs!r}: unknown {bad}; valid: {RS_OPTIONS}")
        if self.rollout_rs_threshold is None:
            raise PolicyLossConfigError(f"{KEY}.rollout_rs_threshold is required with rollout_rs={self.rollout_rs!r}")
        specs = [s.strip() for s in str(self.rollout_rs_threshold).split(",") if s.strip()]
        if len(specs) not in (1, len(options)):
            raise PolicyLossConfigError(
                f"{KEY}.rollout_rs_threshold={self.rollout_rs_threshold!r}: give one threshold or one per option "
                f"({len(options)})"
            )
        bounds = {}
        for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs):
            upper, lower = _floats(spec, "rollout_rs_threshold")
            if option.endswith("k1"):
                bounds[option] = (math.log(1.0 / upper if lower is None else lower), math.log(upper))
            elif lower is not None:
                raise PolicyLossConfigError(f"{KEY}.rollout_rs_threshold={spec!r}: {option} takes one upper bound")
            else:
                bounds[option] = (-math.inf, upper)
        return bounds


def token_divergences(log_ratio: Tensor) -> dict[str, Tensor]:
    """k1, k2, k3 per token from lr = log_prob - rollout_log_prob (clamped to +-20)."""
    lr = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    return {"k1": -lr, "k2": 0.5 * lr.square(), "k3": torch.exp(lr) - 1.0 - lr}


def row_sum(values: Tensor) -> Tensor:
    """(B, L) per-token values of a whole batch -> each row's sum per token (single-process ``sequence_sum``)."""
    return values.sum(-1, keepdim=True).expand_as(values)


def is_weights(
    *, log_ratio: Tensor, loss_mask: Tensor, config: RolloutCorrectionConfig, sequence_sum: SequenceSum = row_sum
) -> Tensor:
    """Truncated (TIS) or IcePop IS weights per token, before batch normalisation; 0 off the mask."""
    level_ratio = log_ratio if config.rollout_is == "token" else sequence_sum(log_ratio * loss_mask)
    raw = torch.exp(torch.clamp(level_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)) * loss_mask
    upper, lower = _floats(config.rollout_is_threshold, "rollout_is_threshold")
    if lower is None:
        return raw.clamp(max=upper).detach()
    return torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw)).detach()


def keep_mask(
    *, log_ratio: Tensor, loss_mask: Tensor, config: RolloutCorrectionConfig, sequence_sum: SequenceSum = row_sum
) -> Tensor:
    """1 where every rejection option keeps the token (or its sequence), 0 where one rejects it."""
    token = token_divergences(log_ratio)
    mask = loss_mask.to(log_ratio.dtype)
    keep = torch.ones_like(log_ratio)
    for option, (low, high) in config.rs_thresholds().items():
        level, k = option.rsplit("_", 1)
        if level == "token":
            stat = token[k]
        elif level == "seq_max":  # max_t k_t <= high  <=>  no loss-mask token of the sequence above high
            stat = torch.where(sequence_sum((token[k] > high).to(mask.dtype) * mask) > 0, math.inf, -math.inf)
        else:
            stat = sequence_sum(token[k] * mask)
            if level == "seq_mean":
                stat = stat / (sequence_sum(mask) + 1e-8)
        keep = keep * ((stat >= low) & (stat <= high)).to(keep.dtype)
    return keep


def is_batch_mean_terms(
    weights: Tensor, loss_mask: Tensor, config: RolloutCorrectionConfig, sequence_sum: SequenceSum = row_sum
) -> Tensor:
    """(numerator, denominator) float64 sums over this slice; their SUM over the mini-batch gives the mean."""
    w, m = weights.double(), loss_mask.double()
    if config.rollout_is == "token":
        return torch.stack([(w * m).sum(), m.sum()])
    count = sequence_sum(m)
    share = torch.where(count > 0, m / count.clamp(min=1e-300), torch.zeros_like(m))
    return torch.stack([(w * m / (count + 1e-8)).sum(), share.sum()])


def batch_mean(terms: Tensor, config: RolloutCorrectionConfig) -> float:
    """The IS weights' mini-batch mean from summed ``is_batch_mean_terms`` (verl's masked-mean epsilons)."""
    count = terms[1] + 1e-8 if config.rollout_is == "token" else terms[1].clamp(min=1e-8)
    return float(terms[0] / count)


def normalized_is_weights(weights: Tensor, mean: float) -> Tensor:
    """The weights over their mini-batch mean, unless that mean is <= 1e-8 (verl's)."""
    return weights / mean if mean > 1e-8 else weights


def bypass_reductions(
    *,
    log_probs: Tensor,
    old_log_probs: Tensor,
    loss_mask: Tensor,
    config: RolloutCorrectionConfig,
    sequence_sum: SequenceSum = row_sum,
    is_mean_terms: Tensor | None = None,
) -> dict[str, Tensor]:
    """bypass_mode's ``reduced``: ``bypass_keep_mask`` and, for reinforce with rollout_is, ``bypass_is_weights``."""
    mask = loss_mask.to(log_probs.dtype)
    log_ratio = log_probs.detach() - old_log_probs
    terms = dict(log_ratio=log_ratio, loss_mask=mask, config=config, sequence_sum=sequence_sum)
    out = {}
    if config.rollout_rs is not None:
        out["bypass_keep_mask"] = keep_mask(**terms)
    if config.loss_type == "reinforce" and config.rollout_is is not None:
        weights = is_weights(**terms)
        if config.rollout_is_batch_normalize:
            assert is_mean_terms is not None, "rollout_is_batch_normalize needs the mini-batch's mean"
            weights = normalized_is_weights(weights, batch_mean(is_mean_terms, config))
        out["bypass_is_weights"] = weights
    return out


def bypass_mode(*, log_probs, old_log_probs, advantages, config, mode, reduced):
    """verl's bypass_mode: old_log_probs are the rollout's; ppo_clip or reinforce (module docstring)."""
    keep = reduced.get("bypass_keep_mask")
    weights = reduced.get("bypass_is_weights")
    if mode.rollout_correction.loss_type == "ppo_clip":
        pg, metrics = vanilla(
            log_probs=log_probs,
            old_log_probs=old_log_probs,
            advantages=advantages,
            config=config,
            mode=mode,
            reduced=reduced,
        )
    else:
        pg = -advantages * log_probs * (1.0 if weights is None else weights)
        metrics = {"ppo_kl": (old_log_probs - log_probs).detach()}
    if weights is not None:
        metrics["rollout_corr/rollout_is_mean"] = weights.detach()
    if keep is not None:
        pg = pg * keep
        metrics["rollout_corr/rollout_rs_masked_fraction"] = (1.0 - keep).detach()
    return pg, metrics


def decoupled_correction(
    *, old_log_probs: Tensor, rollout_log_probs: Tensor, loss_mask: Tensor, config: RolloutCorrectionConfig
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """verl's decoupled mode on the whole batch: (IS weights or None, the loss mask without rejected
    tokens, which leave the contract's counts as in verl, ``rollout_corr/*`` metrics); no mask: error."""
    if not loss_mask.any():
        raise ValueError("algorithm.rollout_correction: the batch has no response token to correct")
    mask = loss_mask.to(old_log_probs.dtype)
    log_ratio = old_log_probs - rollout_log_probs
    metrics: dict[str, float] = {}
    weights = None
    if config.rollout_is is not None:
        weights = is_weights(log_ratio=log_ratio, loss_mask=mask, config=config)
        metrics["rollout_corr/rollout_is_mean"] = float((weights * mask).sum() / (mask.sum() + 1e-8))
        if config.rollout_is_batch_normalize:
            weights, metrics["rollout_corr/rollout_is_batch_norm_factor"] = batch_normalize(weights, mask, config)
    new_mask = mask
    if config.rollout_rs is not None:
        new_mask = mask * keep_mask(log_ratio=log_ratio, loss_mask=mask, config=config)
        metrics["rollout_corr/rollout_rs_masked_fraction"] = float(((1 - new_mask) * mask).sum() / (mask.sum() + 1e-8))
        rejected = (mask - new_mask).sum(-1) > 0
        metrics["rollout_corr/rollout_rs_seq_masked_fraction"] = float(rejected.double().mean())
    return weights, new_mask.to(loss_mask.dtype), metrics


def batch_normalize(weights: Tensor, mask: Tensor, config: RolloutCorrectionConfig) -> tuple[Tensor, float]:
    """(weights / their batch mean, the mean); a mean <= 1e-8 leaves the weights and returns 1.0."""
    mean = batch_mean(is_batch_mean_terms(weights, mask, config), config)
    return normalized_is_weights(weights, mean), mean if mean > 1e-8 else 1.0
