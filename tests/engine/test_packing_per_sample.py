"""``PackedMicroBatch.local_per_sample``: per-sample values (verl's per-sample temperature) spread
over each sample's tokens of the packed stream, ``padding`` on the padding tokens, sliced to the
SP rank. Hand-worked: samples of 3 and 2 tokens, sp = 2: T = 5, T_pad = 6, rank r owns [3r, 3r + 3)."""

import pytest
import torch

from verl_balance.engine.packing import pack_micro_batch


def _packed(sp_rank: int, *, sp_size: int = 2):
    attention_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    micro_batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]), "attention_mask": attention_mask}
    return pack_micro_batch(
        micro_batch, sp_size=sp_size, sp_rank=sp_rank, device=torch.device("cpu"), require_loss_mask=False
    )


@pytest.mark.parametrize(
    ("sp_rank", "expected"),
    [(0, [0.5, 0.5, 0.5]), (1, [2.0, 2.0, 1.0])],  # the last token of rank 1 is padding
)
def test_per_sample_values_cover_each_samples_tokens_and_the_padding_on_this_sp_rank(sp_rank, expected):
    packed = _packed(sp_rank)
    assert (packed.total_len, packed.padded_len) == (5, 6)
    assert packed.local_per_sample(torch.tensor([0.5, 2.0]), padding=1.0).tolist() == expected


def test_without_sp_the_whole_stream_is_local_and_has_no_padding():
    packed = _packed(0, sp_size=1)
    assert packed.local_per_sample(torch.tensor([0.5, 2.0]), padding=1.0).tolist() == [0.5] * 3 + [2.0] * 2
