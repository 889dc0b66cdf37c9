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

from verl_balance.distributed.ulysses import padded_length


class MicroBatchError(ValueError):
    """A micro-batch whose tensors do not follow the wire format."""


_UNROLLED_KEYS = ("input_ids", "position_ids")


@dataclass
class PackedMicroBatch:
    """A packed micro-batch: full (unsliced, padded) tensors plus this SP rank's slice."""

    seq_lens: list[int]
    total_len: int
    padded_len: int
    cu_seqlens: Tensor          # real sequences only, int64 [n + 1]
    cu_seqlens_padded: Tensor   # + the padding segment, spans padded_len tokens
    max_seqlen: int
    tensors: dict[str, Tensor]  # full padded stream, target-aligned (see module docstring)
    sp_rank: int
    sp_size: int
    attention_mask: Tensor = field(repr=False)  # the wire (b, L) mask, for unpacking

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

    def unpack(self, values: Tensor) -> Tensor:
        """Target-aligned packed values [>= total_len] -> wire-aligned (b, L).

        out[i, t] = values at the position predicting token t of sample i; 0 at t = 0 and at
        padding.
        """
        b, width = self.attention_mask.shape
        out = values.new_zeros((b, width))
        keep = torch.ones(self.total_len, dtype=torch.bool, device=values.device)
        keep[self.cu_seqlens[1:] - 1] = False
        tail = out[:, 1:]
        tail[self.attention_mask[:, 1:].bool()] = values[: self.total_len][keep]
        return out


def _shift_targets(x: Tensor, ends: Tensor) -> Tensor:
    shifted = torch.roll(x, shifts=-1, dims=0)
    if len(ends):
        shifted[ends] = 0
    return shifted


def pack_micro_batch(micro_batch: Mapping[str, Tensor], *, sp_size: int, sp_rank: int,
                     device: torch.device, require_loss_mask: bool = True,
                     roll_after_slice: bool = False) -> PackedMicroBatch:
    """Pack a right-padded micro-batch (wire format of HELPERS.md) for this SP rank.

    roll_after_slice reproduces KNOWN_BUGS["roll_after_slice"] for the parity negative
    controls only.
    """
    for key in ("input_ids", "attention_mask") + (("loss_mask",) if require_loss_mask else ()):
        if key not in micro_batch:
            raise MicroBatchError(f"micro-batch lacks {key!r}; it has {sorted(micro_batch)}")
    attention_mask = micro_batch["attention_mask"].to(device)
    if attention_mask.dim() != 2:
        raise MicroBatchError(f"attention_mask must be (b, L), got {tuple(attention_mask.shape)}")
    b, width = attention_mask.shape
    lengths = attention_mask.long().sum(1)
    expected = torch.arange(width, device=device)[None, :] < lengths[:, None]
    bad = ((attention_mask != 0) != expected).any(1) | (lengths == 0)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise MicroBatchError(f"sample {i} of the micro-batch: attention_mask must be 1 on a "
                              "non-empty prefix and 0 after it (right padding)")
    real = expected
    cu = torch.zeros(b + 1, dtype=torch.int64, device=device)
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    padded = padded_length(total, multiple=sp_size)
    ends = cu[1:] - 1

    tensors: dict[str, Tensor] = {}
    for key, value in micro_batch.items():
        if key == "attention_mask" or not isinstance(value, Tensor) or value.shape[:2] != (b, width):
            continue
        flat = value.to(device)[real]
        if key not in _UNROLLED_KEYS and not roll_after_slice:
            flat = _shift_targets(flat, ends)
        tensors[key] = flat
    tensors["targets"] = tensors["input_ids"] if roll_after_slice else _shift_targets(
        tensors["input_ids"], ends)
    tensors["position_ids"] = (torch.cumsum(attention_mask.long(), 1) - 1)[real]
    if "loss_mask" not in tensors:
        tensors["loss_mask"] = torch.zeros(total, device=device)
    tensors["loss_mask"] = tensors["loss_mask"].to(torch.float32)

    pad = padded - total
    for key, value in tensors.items():
        filler = (torch.arange(pad, device=device, dtype=value.dtype) if key == "position_ids"
                  else value.new_zeros((pad,) + value.shape[1:]))
        tensors[key] = torch.cat([value, filler])
    if roll_after_slice:
        # The bug under test: each SP shard shifts its own slice, so every shard edge loses one
        # target and each sequence end is still masked.
        width_local = padded // sp_size
        shard_ends = torch.cat([ends, torch.arange(1, sp_size + 1, device=device) * width_local - 1])
        for key in list(tensors):
            if key in _UNROLLED_KEYS:
                continue
            src = tensors["input_ids"] if key == "targets" else tensors[key]
            chunks = [_shift_targets(c, torch.zeros(0, dtype=torch.long, device=device))
                      for c in src.split(width_local)]
            shifted = torch.cat(chunks)
            shifted[shard_ends] = 0
            tensors[key] = shifted

    cu_padded = torch.cat([cu, cu.new_tensor([padded])]) if pad else cu
    max_seqlen = max([pad] + lengths.tolist())
    return PackedMicroBatch(seq_lens=lengths.tolist(), total_len=total, padded_len=padded,
                            cu_seqlens=cu, cu_seqlens_padded=cu_padded, max_seqlen=max_seqlen,
                            tensors=tensors, sp_rank=sp_rank, sp_size=sp_size,
                            attention_mask=attention_mask)
