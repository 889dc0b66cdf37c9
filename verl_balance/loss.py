"""The loss-normalization contract: per-token weights on the global mini-batch.

Every aggregation mode is a set of per-token weights w over the *global* mini-batch (all
micro-batches of all DP ranks of one optimizer step); the objective is J = sum_t w_t * l_t.

| loss_agg_mode            | w for token t of sequence i (m = loss mask)          |
| ------------------------ | ---------------------------------------------------- |
| token-mean               | m / N,          N = sum of m over the mini-batch     |
| seq-mean-token-mean      | m / (n_i * S),  n_i = sum_t m_i,t, S = #{i: n_i > 0} |
| seq-mean-token-sum       | m / S                                                |
| seq-mean-token-sum-norm  | m / (S * C),    C = loss_scale_factor                |

Invariants:
- N, S and n_i are counted on full (unsliced) sequences and all-reduced (SUM) over the DP group
  only: the SP ranks of one DP group hold the same sequences, so reducing over the whole world
  would count every token sp times.
- Targets are rolled on the packed, unsliced stream before SP slicing (see engine/packing.py), so
  every target token lives on exactly one SP rank and none is lost at a shard edge.
- Each rank back-propagates G * sum over its own token slice of w * l, where G is the engine's
  gradient divide factor (FSDP2 averages gradients over G ranks); the average then equals grad J
  exactly. all_reduce_sum of the local sums over the world equals J: that is the logged loss, in
  training and in evaluation alike (evaluation runs the same code without backward).
- Zero valid tokens anywhere: weights are 0 (never 0/0); a rank still joins every collective.

KNOWN_BUGS are deliberately wrong normalizers reproduced from other frameworks. They exist only
so the parity tests can show that the tests catch them (negative controls); never set them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")

KNOWN_BUGS = {
    "count_over_world": "(a) token/sequence counts all-reduced over the whole world although SP "
                        "ranks hold replicated labels (SFT loss divided by sp)",
    "count_local_shard": "(b) counts taken on the local SP shard and reduced over the DP group "
                         "only while gradients are scaled by the world size (loss inflated ~sp)",
    "eval_local_denominator": "(c) eval numerator all-reduced but the denominator counted on the "
                              "local shard only",
    "roll_after_slice": "(d) targets shifted per SP shard after slicing: one token lost per shard",
    "micro_batch_mean": "(e) mean of per-micro-batch means instead of the global token mean",
}


class LossConfigError(ValueError):
    """A bad loss configuration (unknown loss_agg_mode, bad loss_scale_factor, ...)."""


def check_agg_mode(agg_mode: str) -> None:
    """Raise LossConfigError unless agg_mode is one of AGG_MODES."""
    if agg_mode not in AGG_MODES:
        raise LossConfigError(f"loss_agg_mode={agg_mode!r}; valid: {AGG_MODES}")


def check_bug(bug: str | None) -> None:
    """Raise LossConfigError unless bug is None or a KNOWN_BUGS key."""
    if bug is not None and bug not in KNOWN_BUGS:
        raise LossConfigError(f"inject_bug={bug!r}; valid: None or one of {sorted(KNOWN_BUGS)}")


class LossFn(Protocol):
    """Per-token loss for one micro-batch on this rank's SP slice.

    Called with target-aligned packed tensors: log_probs[t] = log p(target_t | tokens <= t),
    entropy[t] (or None unless `needs_entropy`), and `inputs`, the local slices of every
    per-token tensor of the micro-batch (`loss_mask` and extras such as `advantages`,
    `old_log_probs`), aligned the same way. Returns (per-token loss [T_local], per-token metric
    tensors [T_local]); the engine applies the contract weights and reductions.
    """

    needs_entropy: bool

    def __call__(self, *, log_probs: Tensor, entropy: Tensor | None,
                 inputs: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]: ...


class SFTLoss:
    """Negative log-likelihood of the target tokens (the default loss_fn)."""

    needs_entropy = False

    def __call__(self, *, log_probs: Tensor, entropy: Tensor | None,
                 inputs: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        return -log_probs, {}


def sequence_token_counts(loss_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """n_i = sum of the loss mask over each packed sequence (int64 [num_sequences]).

    Tokens beyond cu_seqlens[-1] (padding) are ignored.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    total = int(cu_seqlens[-1])
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=loss_mask.device), lengths,
                                  output_size=total)
    counts = torch.zeros(len(lengths), dtype=torch.int64, device=loss_mask.device)
    return counts.index_add_(0, seg, (loss_mask[:total] > 0).long())


@dataclass(frozen=True)
class TokenWeights:
    """Contract weights of one rank's micro-batches plus the true global counts."""

    weights: list[Tensor]
    num_tokens: int
    num_sequences: int


def _all_reduce_sum(values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values


def compute_token_weights(*, loss_masks: Sequence[Tensor], cu_seqlens: Sequence[Tensor],
                          agg_mode: str, loss_scale_factor: float | None = None,
                          dp_group: dist.ProcessGroup | None,
                          world_group: dist.ProcessGroup | None = None,
                          local_slices: Sequence[slice] | None = None, training: bool = True,
                          bug: str | None = None) -> TokenWeights:
    """Per-token weights of each micro-batch of this DP rank (full padded stream, not sliced).

    loss_masks[k] / cu_seqlens[k]: the target-aligned loss mask of micro-batch k and the
    boundaries of its real sequences (padding beyond cu_seqlens[k][-1] has mask 0). Collective
    over dp_group (every rank of the mesh must call it). world_group and local_slices (this SP
    rank's token range of each micro-batch) are read only by the KNOWN_BUGS controls.
    """
    check_agg_mode(agg_mode)
    check_bug(bug)
    if agg_mode == "seq-mean-token-sum-norm" and not (loss_scale_factor and loss_scale_factor > 0):
        raise LossConfigError(f"loss_scale_factor={loss_scale_factor!r}: seq-mean-token-sum-norm "
                              "needs a positive constant C")
    device = loss_masks[0].device if loss_masks else torch.device("cpu")
    seq_counts = [sequence_token_counts(m, cu) for m, cu in zip(loss_masks, cu_seqlens)]
    local = torch.tensor([[int(c.sum()), int((c > 0).sum())] for c in seq_counts],
                         dtype=torch.int64, device=device).reshape(-1, 2)
    # Full-sequence counts are identical on the SP ranks of a DP group: reduce over DP only.
    true_totals = _all_reduce_sum(local.sum(0), dp_group)
    per_mb = None
    if bug == "count_over_world":
        totals = _all_reduce_sum(local.sum(0), world_group)
    elif bug == "count_local_shard" or (bug == "eval_local_denominator" and not training):
        shard = torch.tensor([int((m[s] > 0).sum()) for m, s in zip(loss_masks, local_slices)],
                             dtype=torch.int64, device=device)
        totals = true_totals.clone()
        totals[0] = shard.sum()
        if bug == "count_local_shard":
            totals[0] = _all_reduce_sum(totals[0:1], dp_group)[0]
    elif bug == "micro_batch_mean":
        totals = true_totals
        per_mb = _all_reduce_sum(local.clone(), dp_group)
    else:
        totals = true_totals
    weights = []
    for k, (mask, counts, cu) in enumerate(zip(loss_masks, seq_counts, cu_seqlens)):
        n_tok, n_seq = (per_mb[k] if per_mb is not None else totals).tolist()
        scale = 1.0 / len(loss_masks) if per_mb is not None else 1.0
        m = (mask > 0).to(torch.float32)
        # max(., 1) only avoids 0/0: when a count is 0 every mask it covers is 0 as well.
        if agg_mode == "token-mean":
            w = m * (scale / max(n_tok, 1))
        elif agg_mode == "seq-mean-token-mean":
            per_seq = scale / (counts.clamp(min=1).to(torch.float32) * max(n_seq, 1))
            lengths = (cu[1:] - cu[:-1]).long()
            per_tok = torch.repeat_interleave(per_seq, lengths, output_size=int(cu[-1]))
            w = m.clone()
            w[: per_tok.shape[0]] *= per_tok
        elif agg_mode == "seq-mean-token-sum":
            w = m * (scale / max(n_seq, 1))
        else:
            w = m * (scale / (max(n_seq, 1) * loss_scale_factor))
        weights.append(w)
    n_tok, n_seq = true_totals.tolist()
    return TokenWeights(weights=weights, num_tokens=int(n_tok), num_sequences=int(n_seq))
