"""The reduced quantities of the policy-loss modes for a mini-batch held whole on one process.

``reference_reductions`` returns the ``reduced`` mapping the engine otherwise computes with SP-group
and world reductions; clip_cov's draw is verl's, so a seed drops the same tokens as verl.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_balance.algorithms import global_loss_modes as glob
from verl_balance.algorithms import rollout_correction as rc
from verl_balance.algorithms.loss_modes import LossModeConfig, required_reductions
from verl_balance.algorithms.policy_loss import PolicyLossConfig

MEAN_EPS = 1e-8


def _row_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Per-row masked mean (verl's masked_mean(axis=-1)), broadcast back to (B, L)."""
    mean = (values * mask).sum(-1, keepdim=True) / (mask.sum(-1, keepdim=True) + MEAN_EPS)
    return mean.expand_as(values)


def _global_means(advantages: Tensor, log_probs: Tensor, mask: Tensor) -> tuple[float, float]:
    count = mask.sum() + MEAN_EPS
    return float((advantages * mask).sum() / count), float((log_probs.detach() * mask).sum() / count)


def _clip_cov_drop(log_probs, old_log_probs, advantages, mask, config, mode, generator) -> Tensor:
    mean_adv, mean_lp = _global_means(advantages, log_probs, mask)
    cov = glob.token_covariance(
        advantages=advantages, log_probs=log_probs, loss_mask=mask, mean_advantage=mean_adv, mean_log_prob=mean_lp
    )
    candidates = glob.clip_cov_candidates(
        cov=cov,
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        loss_mask=mask,
        config=config,
        mode=mode,
    )
    k = max(int(mode.clip_cov_ratio * int(mask.sum())), 1)
    where = candidates.nonzero()
    drop = torch.zeros_like(mask)
    if len(where):
        chosen = where[torch.randperm(len(where), generator=generator)[: min(k, len(where))]]
        drop[chosen[:, 0], chosen[:, 1]] = 1.0
    return drop


def _kl_cov_select(log_probs, advantages, mask, mode) -> Tensor:
    valid = mask > 0
    select = torch.zeros_like(mask)
    count = int(valid.sum())
    if count == 0:
        return select
    adv, lp = advantages.detach()[valid], log_probs.detach()[valid]
    cov = (adv - adv.mean()) * (lp - lp.mean())
    top = torch.topk(cov, max(1, int(count * mode.kl_cov_ratio)), largest=True).indices
    select[valid.nonzero()[top].unbind(-1)] = 1.0
    return select


def _bypass(log_probs, old_log_probs, mask, mode: LossModeConfig) -> dict[str, Tensor]:
    corr = mode.rollout_correction
    terms = None
    if corr.rollout_is_batch_normalize and corr.rollout_is is not None:
        log_ratio = log_probs.detach() - old_log_probs
        weights = rc.is_weights(log_ratio=log_ratio, loss_mask=mask, config=corr)
        terms = rc.is_batch_mean_terms(weights, mask, corr)
    return rc.bypass_reductions(
        log_probs=log_probs, old_log_probs=old_log_probs, loss_mask=mask, config=corr, is_mean_terms=terms
    )


def reference_reductions(
    *,
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    config: PolicyLossConfig,
    mode: LossModeConfig,
    rollout_is_weights: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, Tensor]:
    """Every reduction ``required_reductions(mode)`` names, for (B, L) rows (one sequence each)."""
    mask = loss_mask.to(log_probs.dtype)
    name = mode.loss_mode
    if name == "gspo":
        x = (log_probs - old_log_probs).detach()
        mean = (x * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        return {"seq_mean_log_ratio": mean.expand_as(x)}
    if name == "geo_mean":
        x_clip, _ = glob.geo_mean_clipped_log_ratio(
            log_probs=log_probs.detach(), old_log_probs=old_log_probs, advantages=advantages, config=config
        )
        out = {"seq_mean_clipped_log_ratio": _row_mean(x_clip, mask), "seq_mean_advantage": _row_mean(advantages, mask)}
        if rollout_is_weights is not None:
            out["seq_is_weight"] = torch.exp(_row_mean(torch.log(rollout_is_weights + 1e-10), mask))
        return out
    if name == "clip_cov":
        return {"clip_cov_drop": _clip_cov_drop(log_probs, old_log_probs, advantages, mask, config, mode, generator)}
    if name == "kl_cov":
        return {"kl_cov_select": _kl_cov_select(log_probs, advantages, mask, mode)}
    if name == "bypass_mode":
        out = _bypass(log_probs, old_log_probs, mask, mode)
        return {k: out[k] for k in required_reductions(mode)}
    return {}
