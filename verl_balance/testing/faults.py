"""Fault injection for tests: parity negative controls and a loss that turns NaN.

The negative controls are deliberately wrong normalizers from other frameworks, so the parity tests
can show they catch them; production code has no switch for them. ``FaultyTrainEngine`` replaces the
engine's ``_pack`` and ``_token_weights`` seams with the broken versions below.
``NaNLossTrainEngine`` and ``InfWeightsTrainEngine`` make the loss NaN or the weights inf from a
chosen step on, for the non-finite guards (run through ``ActorWorker.engine_cls``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from verl_balance.batch_keys import INPUT_IDS_KEY, LOSS_MASK_KEY, POSITION_IDS_KEY
from verl_balance.engine.packing import PackedMicroBatch, pack_micro_batch, shift_targets
from verl_balance.engine.train_engine import TrainEngine
from verl_balance.loss import (
    TokenWeights,
    all_reduce_sum,
    check_agg_mode,
    check_loss_scale_factor,
    contract_weights,
    sequence_token_counts,
)

KNOWN_BUGS = {
    "count_over_world": "(a) token/sequence counts all-reduced over the whole world although SP "
    "ranks hold replicated labels (SFT loss divided by sp)",
    "count_local_shard": "(b) counts taken on the local SP shard and reduced over the DP group "
    "only while gradients are scaled by the world size (loss inflated ~sp)",
    "eval_local_denominator": "(c) eval numerator all-reduced but the denominator counted on the local shard only",
    "roll_after_slice": "(d) targets shifted per SP shard after slicing: one token lost per shard",
    "micro_batch_mean": "(e) mean of per-micro-batch means instead of the global token mean",
    "tool_tokens_counted": "(f) multi-turn: the tool-answer tokens inside a response counted in the "
    "token and sequence denominators (every token from a sequence's first to its last loss token)",
}


class UnknownBugError(ValueError):
    """A bug name that is not a KNOWN_BUGS key."""


def check_bug(bug: str) -> None:
    """Raise UnknownBugError unless bug is a KNOWN_BUGS key."""
    if bug not in KNOWN_BUGS:
        raise UnknownBugError(f"bug={bug!r}; valid: {sorted(KNOWN_BUGS)}")


def faulty_token_weights(
    bug: str,
    *,
    loss_masks: Sequence[Tensor],
    cu_seqlens: Sequence[Tensor],
    agg_mode: str,
    loss_scale_factor: float | None = None,
    dp_group: dist.ProcessGroup | None,
    world_group: dist.ProcessGroup | None = None,
    local_slices: Sequence[slice] | None = None,
    training: bool = True,
) -> TokenWeights:
    """compute_token_weights with the counting error ``bug`` (true counts still returned). Collective over
    dp_group (and world_group for count_over_world) on every rank alike."""
    check_bug(bug)
    check_agg_mode(agg_mode)
    check_loss_scale_factor(agg_mode, loss_scale_factor)
    device = loss_masks[0].device if loss_masks else torch.device("cpu")
    seq_counts = [sequence_token_counts(m, cu) for m, cu in zip(loss_masks, cu_seqlens)]
    if bug == "tool_tokens_counted":
        seq_counts = [sequence_token_counts(_holes_filled(m, cu), cu) for m, cu in zip(loss_masks, cu_seqlens)]
    local = torch.tensor(
        [[int(c.sum()), int((c > 0).sum())] for c in seq_counts], dtype=torch.int64, device=device
    ).reshape(-1, 2)
    true_totals = all_reduce_sum(local.sum(0), dp_group)
    per_mb = None
    if bug == "count_over_world":
        totals = all_reduce_sum(local.sum(0), world_group)
    elif bug == "count_local_shard" or (bug == "eval_local_denominator" and not training):
        shard = torch.tensor(
            [int((m[s] > 0).sum()) for m, s in zip(loss_masks, local_slices)], dtype=torch.int64, device=device
        )
        totals = true_totals.clone()
        totals[0] = shard.sum()
        if bug == "count_local_shard":
            totals[0] = all_reduce_sum(totals[0:1], dp_group)[0]
    elif bug == "micro_batch_mean":
        totals = true_totals
        per_mb = all_reduce_sum(local.clone(), dp_group)
    else:
        totals = true_totals
    weights = []
    for k, (mask, counts, cu) in enumerate(zip(loss_masks, seq_counts, cu_seqlens)):
        n_tok, n_seq = (per_mb[k] if per_mb is not None else totals).tolist()
        weights.append(
            contract_weights(
                loss_mask=mask,
                seq_counts=counts,
                cu_seqlens=cu,
                num_tokens=n_tok,
                num_sequences=n_seq,
                agg_mode=agg_mode,
                loss_scale_factor=loss_scale_factor,
                scale=1.0 / len(loss_masks) if per_mb is not None else 1.0,
            )
        )
    n_tok, n_seq = true_totals.tolist()
    return TokenWeights(weights=weights, num_tokens=int(n_tok), num_sequences=int(n_seq))


def _holes_filled(loss_mask: Tensor, cu_seqlens: Tensor) -> Tensor:
    """The loss mask with every sequence's span from its first to its last loss token set to 1."""
    filled = loss_mask.clone()
    bounds = cu_seqlens.cpu().tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        on = torch.nonzero(loss_mask[start:end] > 0).flatten()
        if len(on):
            filled[start + int(on[0]) : start + int(on[-1]) + 1] = 1
    return filled


def pack_rolled_after_slice(
    micro_batch: Mapping[str, Tensor],
    *,
    sp_size: int,
    sp_rank: int,
    device: torch.device,
    require_loss_mask: bool = True,
) -> PackedMicroBatch:
    """pack_micro_batch, except that every SP shard shifts its own slice: each shard edge loses one
    target (KNOWN_BUGS["roll_after_slice"]); sequence ends stay masked."""
    packed = pack_micro_batch(
        micro_batch, sp_size=sp_size, sp_rank=sp_rank, device=device, require_loss_mask=require_loss_mask
    )
    real = packed.attention_mask.cpu() != 0
    width_local = packed.padded_len // sp_size
    pad = packed.padded_len - packed.total_len
    ends = packed.cu_seqlens_host[1:] - 1
    shard_ends = torch.cat([ends, torch.arange(1, sp_size + 1) * width_local - 1])
    for key, value in packed.tensors.items():
        if key in (INPUT_IDS_KEY, POSITION_IDS_KEY):
            continue
        source = micro_batch[INPUT_IDS_KEY] if key == "targets" else micro_batch.get(key)
        if source is None:
            continue  # a loss mask that was not on the wire stays all zero
        flat = source.cpu()[real].to(value.dtype)
        flat = torch.cat([flat, flat.new_zeros((pad,) + flat.shape[1:])])
        chunks = [shift_targets(c, torch.zeros(0, dtype=torch.long)) for c in flat.split(width_local)]
        shifted = torch.cat(chunks)
        shifted[shard_ends] = 0
        packed.tensors[key] = shifted.to(device)
    return packed


class FaultyTrainEngine(TrainEngine):
    """A TrainEngine running the known-bad normalizer ``bug`` (parity negative controls only)."""

    def __init__(self, *, bug: str, **kwargs) -> None:
        check_bug(bug)
        self.bug = bug
        super().__init__(**kwargs)

    def _pack(self, micro_batches, *, require_loss_mask: bool, pack=pack_micro_batch) -> list[PackedMicroBatch]:
        if self.bug == "roll_after_slice":
            pack = pack_rolled_after_slice
        return super()._pack(micro_batches, require_loss_mask=require_loss_mask, pack=pack)

    def _token_weights(self, packed: Sequence[PackedMicroBatch], *, training: bool) -> TokenWeights:
        return faulty_token_weights(
            self.bug,
            loss_masks=[p.tensors[LOSS_MASK_KEY] for p in packed],
            cu_seqlens=[p.cu_seqlens_host for p in packed],
            agg_mode=self.config.loss_agg_mode,
            loss_scale_factor=self.config.loss_scale_factor,
            dp_group=self.layout.dp_group,
            world_group=self.layout.world_group,
            local_slices=[p.local_slice for p in packed],
            training=training,
        )


class NaNLossTrainEngine(TrainEngine):
    """A TrainEngine whose training loss is NaN from 1-based train step ``nan_from_step`` on (a class
    attribute, so a worker subclass can carry it across processes); eval is unaffected."""

    nan_from_step: int = 3

    def _token_weights(self, packed: Sequence[PackedMicroBatch], *, training: bool) -> TokenWeights:
        weights = super()._token_weights(packed, training=training)
        if training and self.global_step + 1 >= self.nan_from_step:
            return dataclasses.replace(weights, weights=[w * float("nan") for w in weights.weights])
        return weights


class InfWeightsTrainEngine(TrainEngine):
    """A TrainEngine whose update of 1-based train step ``inf_after_step`` sets every weight to inf (that
    step logs a finite loss, the next ones do not)."""

    inf_after_step: int = 3

    def optimizer_step(self) -> dict:
        result = super().optimizer_step()
        if self.global_step + 1 == self.inf_after_step:
            with torch.no_grad():
                for param in self.model.parameters():
                    param.fill_(float("inf"))
        return result
