"""clip_cov's and kl_cov's token selections over the whole mini-batch, from the local slices of every
micro-batch of every rank (global_loss_modes.py states the formulas).

The caller supplies ``world_sum`` (in-place SUM over every rank) and ``world_gather`` (equal 1-D
tensors, concatenated in rank order); every rank must call them. Exactly k tokens are selected by
smallest keys, ties in rank order; keys are independent of the holding rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from verl_balance.algorithms import global_loss_modes as glob

HASH_MODULUS = 2147483647  # 2^31 - 1
HASH_MULTIPLIERS = (48271, 69621)


def sequence_fingerprint_terms(input_ids: Tensor, position_ids: Tensor) -> Tensor:
    """Per-token float64 terms whose sum over a sequence fingerprints its token ids (exact below 2^53)."""
    coef = (position_ids.long() * 2654435761 + 97) % HASH_MODULUS
    return ((input_ids.long() % HASH_MODULUS) * coef % HASH_MODULUS).double()


def token_hash_keys(fingerprint: Tensor, position_ids: Tensor, *, seed: int) -> Tensor:
    """int64 keys < 2^62 from (sequence fingerprint, position, seed): two 31-bit multiplicative hashes."""
    base = fingerprint.long() % HASH_MODULUS
    halves = []
    for mult in HASH_MULTIPLIERS:
        h = (base * mult + position_ids.long() + 1) % HASH_MODULUS
        h = (h * mult + seed % HASH_MODULUS) % HASH_MODULUS
        halves.append((h * mult) % HASH_MODULUS)
    return halves[0] * (1 << 31) + halves[1]


def select_smallest(
    keys: Sequence[Tensor], valid: Sequence[Tensor], *, k: int, world_sum, world_gather
) -> list[Tensor]:
    """1.0 on exactly min(k, #valid over the world) valid tokens with the smallest keys (module docstring)."""
    flat = torch.cat([key[v] for key, v in zip(keys, valid)]) if keys else torch.zeros(0)
    pad = torch.finfo(flat.dtype).max if flat.dtype.is_floating_point else torch.iinfo(flat.dtype).max
    local = torch.sort(flat).values[:k]
    local = torch.cat([local, local.new_full((k - len(local),), pad)])
    gathered, _ = world_gather(local)
    threshold = torch.sort(gathered).values[k - 1]
    below = sum(int((key[v] < threshold).sum()) for key, v in zip(keys, valid))
    ties = sum(int((key[v] == threshold).sum()) for key, v in zip(keys, valid))
    counts = torch.tensor([below, ties], dtype=torch.float64)
    world_sum(counts)
    tie_counts, rank = world_gather(torch.tensor([ties], dtype=torch.float64))
    need = max(k - int(counts[0]), 0) if threshold != pad else 0
    skip = int(tie_counts[:rank].sum())
    take = min(max(need - skip, 0), ties)
    out = []
    for key, v in zip(keys, valid):
        selected = v & (key < threshold)
        tie = v & (key == threshold)
        order = torch.cumsum(tie.flatten().long(), 0).reshape(tie.shape)
        selected |= tie & (order <= take)
        take -= min(int(tie.sum()), take)
        out.append(selected)
    return out


def covariance_selections(
    *,
    log_probs: Sequence[Tensor],
    old_log_probs: Sequence[Tensor],
    advantages: Sequence[Tensor],
    loss_masks: Sequence[Tensor],
    hash_keys: Callable[[int], Tensor] | None,
    num_tokens: int,
    config,
    mode,
    world_sum,
    world_gather,
) -> list[dict[str, Tensor]]:
    """Per micro-batch {"clip_cov_drop" or "kl_cov_select": 0/1 per local token} (global_loss_modes.py)."""
    sums = torch.zeros(2, dtype=torch.float64)
    for lp, adv, m in zip(log_probs, advantages, loss_masks):
        sums += torch.stack([(adv.double() * m).sum(), (lp.detach().double() * m).sum()]).cpu()
    world_sum(sums)
    mean_adv, mean_lp = (sums / (num_tokens + glob.MEAN_EPS)).tolist()
    covs = [
        glob.token_covariance(advantages=a, log_probs=lp, loss_mask=m, mean_advantage=mean_adv, mean_log_prob=mean_lp)
        for lp, a, m in zip(log_probs, advantages, loss_masks)
    ]
    if mode.loss_mode == "kl_cov":
        k = max(1, int(num_tokens * mode.kl_cov_ratio))
        valid = [m > 0 for m in loss_masks]
        chosen = select_smallest(
            [-c.double() for c in covs], valid, k=k, world_sum=world_sum, world_gather=world_gather
        )
        return [{"kl_cov_select": c.to(lp.dtype)} for c, lp in zip(chosen, log_probs)]
    k = max(int(mode.clip_cov_ratio * num_tokens), 1)
    candidates = [
        glob.clip_cov_candidates(
            cov=c, log_probs=lp, old_log_probs=old, advantages=a, loss_mask=m, config=config, mode=mode
        )
        for c, lp, old, a, m in zip(covs, log_probs, old_log_probs, advantages, loss_masks)
    ]
    keys = [hash_keys(i) for i in range(len(covs))]
    chosen = select_smallest(keys, candidates, k=k, world_sum=world_sum, world_gather=world_gather)
    return [{"clip_cov_drop": c.to(lp.dtype)} for c, lp in zip(chosen, log_probs)]
