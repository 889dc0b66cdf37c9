"""The loss-normalization contract: per-token weights on the global mini-batch.

Every aggregation mode is a set of per-token weights w over the *global* mini-batch (all
micro-batches of all DP ranks of one optimizer step); the objective is J = sum_t w_t * l_t.

| loss_agg_mode            | w for token t of sequence i (m = loss mask)          |
| ------------------------ | ---------------------------------------------------- |
| token-mean               | m / N,          N = sum of m over the mini-batch     |
| seq-mean-token-mean      | m / (n_i * S),  n_i = sum_t m_i,t, S = #{i: n_i > 0} |
| seq-mean-token-sum       | m / S                                                |
| seq-mean-token-sum-norm  | m / (S * C),    C = loss_scale_factor                |
| token-sum                | m  (verl's token-sum: the sum over the mini-batch)   |

Invariants:
- N, S and n_i are counted on full (unsliced) sequences and all-reduced (SUM) over the DP group
  only (SP ranks of one DP group hold the same sequences).
- Every target token lives on exactly one SP rank (targets are rolled before SP slicing).
- Each rank back-propagates G * sum over its own token slice of w * l (G the engine's gradient
  divide factor), so the average equals grad J exactly; the world SUM of the local sums is J.
- Zero valid tokens anywhere: weights are 0 (never 0/0); a rank still joins every collective.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
"""The modes the recipes accept (``check_agg_mode``) and the parity matrix covers."""
WEIGHT_MODES = (*AGG_MODES, "token-sum")
"""AGG_MODES plus verl's token-sum (the RL losses), which the parity matrix does not cover yet."""


class LossConfigError(ValueError):
    """A bad loss configuration (unknown loss_agg_mode, bad loss_scale_factor, ...)."""


def check_agg_mode(agg_mode: str, *, valid: tuple[str, ...] = AGG_MODES) -> None:
    """Raise LossConfigError unless agg_mode is one of ``valid`` (AGG_MODES)."""
    if agg_mode not in valid:
        near = difflib.get_close_matches(str(agg_mode), valid, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise LossConfigError(f"loss_agg_mode={agg_mode!r} is not valid{hint}; valid: {valid}")


class LossFn(Protocol):
    """Per-token loss for one micro-batch on this rank's SP slice: returns (loss [T_local], metrics
    [T_local]); the engine applies the contract weights."""

    needs_entropy: bool

    def __call__(
        self, *, log_probs: Tensor, entropy: Tensor | None, inputs: Mapping[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


class SFTLoss:
    """Negative log-likelihood of the target tokens (the default loss_fn)."""

    needs_entropy = False

    def __call__(
        self, *, log_probs: Tensor, entropy: Tensor | None, inputs: Mapping[str, Tensor]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        return -log_probs, {}


def sequence_token_counts(loss_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """n_i = the loss mask's sum per packed sequence (int64, mask's device); padding beyond cu_seqlens ignored."""
    cu_host = cu_seqlens.cpu()
    lengths = (cu_host[1:] - cu_host[:-1]).long()
    total = int(cu_host[-1])
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=total)
    counts = torch.zeros(len(lengths), dtype=torch.int64, device=loss_mask.device)
    return counts.index_add_(0, seg.to(loss_mask.device, non_blocking=True), (loss_mask[:total] > 0).long())


@dataclass(frozen=True)
class TokenWeights:
    """Contract weights of one rank's micro-batches plus the true global counts."""

    weights: list[Tensor]
    num_tokens: int
    num_sequences: int


def all_reduce_sum(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """In-place SUM over ``group`` (a no-op for None or a group of one); returns ``values``."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def check_loss_scale_factor(agg_mode: str, loss_scale_factor: float | None) -> None:
    """Raise LossConfigError when seq-mean-token-sum-norm lacks a positive constant C."""
    if agg_mode == "seq-mean-token-sum-norm" and not (loss_scale_factor and loss_scale_factor > 0):
        raise LossConfigError(
            f"loss_scale_factor={loss_scale_factor!r}: seq-mean-token-sum-norm needs a positive constant C"
        )


def contract_weights(
    *,
    loss_mask: Tensor,
    seq_counts: Tensor,
    cu_seqlens: Tensor,
    num_tokens: float,
    num_sequences: float,
    agg_mode: str,
    loss_scale_factor: float | None = None,
    scale: float = 1.0,
) -> Tensor:
    """The table above for one micro-batch from global N, S and its n_i, times ``scale``; 0 counts give 0."""
    m = (loss_mask > 0).to(torch.float32)
    if agg_mode == "token-sum":
        return m * scale
    if agg_mode == "token-mean":
        return m * (scale / max(num_tokens, 1))
    if agg_mode == "seq-mean-token-mean":
        per_seq = scale / (seq_counts.clamp(min=1).to(torch.float32) * max(num_sequences, 1))
        cu_host = cu_seqlens.cpu()
        lengths = (cu_host[1:] - cu_host[:-1]).long().to(per_seq.device, non_blocking=True)
        per_tok = torch.repeat_interleave(per_seq, lengths, output_size=int(cu_host[-1]))
        w = m.clone()
        w[: per_tok.shape[0]] *= per_tok
        return w
    if agg_mode == "seq-mean-token-sum":
        return m * (scale / max(num_sequences, 1))
    return m * (scale / (max(num_sequences, 1) * loss_scale_factor))


def compute_token_weights(
    *,
    loss_masks: Sequence[Tensor],
    cu_seqlens: Sequence[Tensor],
    agg_mode: str,
    loss_scale_factor: float | None = None,
    dp_group: dist.ProcessGroup | None,
) -> TokenWeights:
    """Per-token weights of each micro-batch of this DP rank (full padded stream, not sliced).
    Collective over dp_group: every rank must call this (one all-reduce)."""
    check_agg_mode(agg_mode, valid=WEIGHT_MODES)
    check_loss_scale_factor(agg_mode, loss_scale_factor)
    device = loss_masks[0].device if loss_masks else torch.device("cpu")
    seq_counts = [sequence_token_counts(m, cu) for m, cu in zip(loss_masks, cu_seqlens)]
    local = torch.zeros(2, dtype=torch.int64, device=device)
    for c in seq_counts:
        local += torch.stack([c.sum(), (c > 0).sum()])
    # Full-sequence counts are identical on the SP ranks of a DP group: reduce over DP only.
    num_tokens, num_sequences = all_reduce_sum(local, dp_group).tolist()
    weights = [
        contract_weights(
            loss_mask=mask,
            seq_counts=counts,
            cu_seqlens=cu,
            num_tokens=num_tokens,
            num_sequences=num_sequences,
            agg_mode=agg_mode,
            loss_scale_factor=loss_scale_factor,
        )
        for mask, counts, cu in zip(loss_masks, seq_counts, cu_seqlens)
    ]
    return TokenWeights(weights=weights, num_tokens=int(num_tokens), num_sequences=int(num_sequences))
