"""Right-padded (b, L) micro-batches -> one packed, target-aligned, SP-sliced token stream.

Invariants:
- Sample i's real tokens are attention_mask[i, :len_i] (contiguous from position 0); they are
  concatenated in sample order; position ids restart at 0 for every sample.
- Target alignment: at packed position p (token t of sample i) the target is token t+1 of
  sample i and every per-token wire tensor x (loss_mask, advantages, ...) is read as x[i, t+1];
  the last token of each sample has no target (loss mask 0). The shift is done on the packed,
  UNSLICED stream, so no SP shard loses a target at its edge.
- The stream is padded to T_pad = ceil(T / sp) * sp (at least sp tokens, so an empty micro-batch
  still runs a forward on every rank); padding forms its own attention segment with loss mask 0.
  SP rank r owns tokens [r * T_pad / sp, (r + 1) * T_pad / sp).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from verl_balance.batch_keys import ATTENTION_MASK_KEY, INPUT_IDS_KEY, LOSS_MASK_KEY, POSITION_IDS_KEY
from verl_balance.distributed.ulysses import padded_length


class MicroBatchError(ValueError):
    """A micro-batch whose tensors do not follow the wire format."""


_UNROLLED_KEYS = (INPUT_IDS_KEY, POSITION_IDS_KEY)


@dataclass
class PackedMicroBatch:
    """A packed micro-batch: full (unsliced, padded) tensors plus this SP rank's slice."""

    seq_lens: list[int]
    total_len: int
    padded_len: int
    cu_seqlens: Tensor  # real sequences only, int64 [n + 1], on the device
    cu_seqlens_padded: Tensor  # + the padding segment, spans padded_len tokens, on the device
    max_seqlen: int
    tensors: dict[str, Tensor]  # full padded stream, target-aligned (see module docstring)
    sp_rank: int
    sp_size: int
    attention_mask: Tensor = field(repr=False)  # the wire (b, L) mask, for unpacking
    cu_seqlens_host: Tensor | None = field(default=None, repr=False)  # cu_seqlens on the CPU

    @property
    def num_samples(self) -> int:
        return len(self.seq_lens)

    @property
    def local_slice(self) -> slice:
        """This SP rank's token range of the padded stream."""
        width = self.padded_len // self.sp_size
        return slice(self.sp_rank * width, (self.sp_rank + 1) * width)

    def local(self, key: str) -> Tensor:
        """This SP rank's slice of a full packed tensor."""
        return self.tensors[key][self.local_slice]

    def local_inputs(self) -> dict[str, Tensor]:
        """Local slices of every per-token tensor (what a LossFn receives as `inputs`)."""
        return {k: v[self.local_slice] for k, v in self.tensors.items()}

    def local_per_sample(self, values: Tensor, *, padding: float) -> Tensor:
        """Per-sample values [num_samples] -> per-token [padded_len / sp] over this SP rank's slice
        (each sample's value on all its tokens, ``padding`` on the padding tokens), on the device."""
        per_token = torch.repeat_interleave(values.cpu(), torch.as_tensor(self.seq_lens))
        per_token = torch.cat([per_token, per_token.new_full((self.padded_len - self.total_len,), padding)])
        return per_token[self.local_slice].to(self.tensors[INPUT_IDS_KEY].device)

    def unpack(self, values: Tensor) -> Tensor:
        """Target-aligned packed values [>= total_len] -> wire-aligned (b, L): out[i, t] predicts
        token t of sample i; 0 at t = 0 and at padding.
        """
        b, width = self.attention_mask.shape
        out = values.new_zeros((b, width))
        keep = torch.ones(self.total_len, dtype=torch.bool, device=values.device)
        keep[self.cu_seqlens[1:] - 1] = False
        tail = out[:, 1:]
        tail[self.attention_mask[:, 1:].bool()] = values[: self.total_len][keep]
        return out


def shift_targets(x: Tensor, ends: Tensor) -> Tensor:
    """x rolled one token left (x[p] <- x[p + 1]), zero at the given sequence-end positions."""
    shifted = torch.roll(x, shifts=-1, dims=0)
    if len(ends):
        shifted[ends] = 0
    return shifted


def pack_micro_batch(
    micro_batch: Mapping[str, Tensor],
    *,
    sp_size: int,
    sp_rank: int,
    device: torch.device,
    require_loss_mask: bool = True,
) -> PackedMicroBatch:
    """Pack a right-padded micro-batch (the wire format of docs/design.md) for this SP rank on the
    CPU, then copy it to ``device`` without waiting (device-resident wire tensors cost a wait).
    """
    attention_mask, lengths, real = _checked_lengths(micro_batch, require_loss_mask=require_loss_mask)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    padded = padded_length(total, multiple=sp_size)
    pad = padded - total
    tensors = _target_aligned_stream(micro_batch, real, cu)
    tensors = {key: _pad_stream(key, value, pad).to(device, non_blocking=True) for key, value in tensors.items()}
    cu_padded = torch.cat([cu, cu.new_tensor([padded])]) if pad else cu
    seq_lens = lengths.tolist()
    return PackedMicroBatch(
        seq_lens=seq_lens,
        total_len=total,
        padded_len=padded,
        cu_seqlens=cu.to(device, non_blocking=True),
        cu_seqlens_padded=cu_padded.to(device, non_blocking=True),
        max_seqlen=max([pad] + seq_lens),
        tensors=tensors,
        sp_rank=sp_rank,
        sp_size=sp_size,
        attention_mask=attention_mask.to(device, non_blocking=True),
        cu_seqlens_host=cu,
    )


def _checked_lengths(micro_batch: Mapping[str, Tensor], *, require_loss_mask: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(CPU attention mask, sample lengths, real-token mask); MicroBatchError unless the required
    keys are there and every sample is a non-empty right-padded prefix."""
    for key in (INPUT_IDS_KEY, ATTENTION_MASK_KEY) + ((LOSS_MASK_KEY,) if require_loss_mask else ()):
        if key not in micro_batch:
            raise MicroBatchError(f"micro-batch lacks {key!r}; it has {sorted(micro_batch)}")
    attention_mask = micro_batch[ATTENTION_MASK_KEY].cpu()
    if attention_mask.dim() != 2:
        raise MicroBatchError(f"attention_mask must be (b, L), got {tuple(attention_mask.shape)}")
    lengths = attention_mask.long().sum(1)
    real = torch.arange(attention_mask.shape[1])[None, :] < lengths[:, None]
    if not (torch.equal(attention_mask != 0, real) and bool((lengths > 0).all())):
        bad = ((attention_mask != 0) != real).any(1) | (lengths == 0)
        i = int(bad.nonzero()[0])
        raise MicroBatchError(
            f"sample {i} of the micro-batch: attention_mask must be 1 on a "
            "non-empty prefix and 0 after it (right padding)"
        )
    return attention_mask, lengths, real


def _target_aligned_stream(micro_batch: Mapping[str, Tensor], real: Tensor, cu: Tensor) -> dict[str, Tensor]:
    """The unpadded packed stream on the CPU: every per-token wire tensor's real tokens, shifted to
    the target alignment (input_ids / position_ids unshifted), plus ``targets``, ``position_ids`` and
    a float32 ``loss_mask``."""
    b, width = real.shape
    index = real.reshape(-1).nonzero().squeeze(1)
    ends = cu[1:] - 1
    tensors: dict[str, Tensor] = {}
    for key, value in micro_batch.items():
        if key == ATTENTION_MASK_KEY or not isinstance(value, Tensor) or value.shape[:2] != (b, width):
            continue
        if key == POSITION_IDS_KEY:  # rebuilt below (restarting at 0); the slot keeps the key order
            tensors[key] = index
            continue
        flat = value.cpu().flatten(0, 1).index_select(0, index)
        tensors[key] = flat if key in _UNROLLED_KEYS else shift_targets(flat, ends)
    tensors["targets"] = shift_targets(tensors[INPUT_IDS_KEY], ends)
    tensors[POSITION_IDS_KEY] = index % width if width else index  # token t of its sample is at t
    if LOSS_MASK_KEY not in tensors:
        tensors[LOSS_MASK_KEY] = torch.zeros(int(cu[-1]))
    tensors[LOSS_MASK_KEY] = tensors[LOSS_MASK_KEY].to(torch.float32)
    return tensors


def _pad_stream(key: str, value: Tensor, pad: int) -> Tensor:
    """``value`` followed by ``pad`` padding tokens (its own attention segment)."""
    if not pad:
        return value
    if key == POSITION_IDS_KEY:
        return torch.cat([value, torch.arange(pad, dtype=value.dtype)])
    return torch.cat([value, value.new_zeros((pad,) + value.shape[1:])])
