"""Loss contract weights (hand-worked examples) and target alignment of the packed stream."""

import pytest
import torch

from verl_balance.engine.packing import MicroBatchError, pack_micro_batch
from verl_balance.loss import (
    AGG_MODES,
    LossConfigError,
    compute_token_weights,
    sequence_token_counts,
)
from verl_balance.testing.faults import FaultyTrainEngine, faulty_token_weights, pack_rolled_after_slice

CPU = torch.device("cpu")

# Two micro-batches (one DP rank, no process group). Target-aligned masks:
# mb0: seq a = [1, 1, 0] (n=2), seq b = [0, 0] (n=0);  mb1: seq c = [1, 1, 1, 1, 0] (n=4), pad 1
MASKS = [torch.tensor([1.0, 1, 0, 0, 0]), torch.tensor([1.0, 1, 1, 1, 0, 0])]
CUS = [torch.tensor([0, 3, 5]), torch.tensor([0, 5])]


def hand_weights(mode, c=None):
    n_seq = 2  # N = 2 + 4 = 6, S = |{a, c}| = 2
    if mode == "token-mean":
        return [[1 / 6, 1 / 6, 0, 0, 0], [1 / 6] * 4 + [0, 0]]
    if mode == "seq-mean-token-mean":
        return [[1 / 4, 1 / 4, 0, 0, 0], [1 / 8] * 4 + [0, 0]]
    scale = 1 / n_seq if mode == "seq-mean-token-sum" else 1 / (n_seq * c)
    return [[scale, scale, 0, 0, 0], [scale] * 4 + [0, 0]]


@pytest.mark.parametrize("mode", AGG_MODES)
def test_weights_match_hand_worked_example(mode):
    out = compute_token_weights(loss_masks=MASKS, cu_seqlens=CUS, agg_mode=mode, loss_scale_factor=4.0, dp_group=None)
    assert (out.num_tokens, out.num_sequences) == (6, 2)
    for got, want in zip(out.weights, hand_weights(mode, 4.0)):
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32))


def test_all_zero_mask_gives_zero_weights_not_nan():
    masks = [torch.zeros(4)]
    for mode in AGG_MODES:
        out = compute_token_weights(
            loss_masks=masks, cu_seqlens=[torch.tensor([0, 4])], agg_mode=mode, loss_scale_factor=1.0, dp_group=None
        )
        assert out.num_tokens == 0 and torch.equal(out.weights[0], torch.zeros(4))


def test_micro_batch_mean_control_differs_from_global_mean():
    good = compute_token_weights(loss_masks=MASKS, cu_seqlens=CUS, agg_mode="token-mean", dp_group=None)
    bad = faulty_token_weights(
        "micro_batch_mean", loss_masks=MASKS, cu_seqlens=CUS, agg_mode="token-mean", dp_group=None
    )
    assert float(bad.weights[0][0]) == pytest.approx(1 / 4)  # 1 / (n_mb0 * 2 micro-batches)
    assert not torch.allclose(good.weights[0], bad.weights[0])


def test_sequence_token_counts_ignore_padding():
    counts = sequence_token_counts(torch.tensor([1.0, 0, 1, 1, 1, 1]), torch.tensor([0, 2, 4]))
    assert counts.tolist() == [1, 2]


def test_bad_config_is_rejected_with_valid_choices():
    with pytest.raises(LossConfigError, match="token-mean"):
        compute_token_weights(loss_masks=MASKS, cu_seqlens=CUS, agg_mode="mean", dp_group=None)
    with pytest.raises(LossConfigError, match="loss_scale_factor"):
        compute_token_weights(loss_masks=MASKS, cu_seqlens=CUS, dp_group=None, agg_mode="seq-mean-token-sum-norm")


def wire_batch():
    # sample 0: 4 tokens, sample 1: 3 tokens, sample 2: 5 tokens (right-padded to 6)
    lengths = [4, 3, 5]
    ids = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    loss = torch.zeros(3, 6)
    adv = torch.zeros(3, 6)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.arange(n) + 10 * (i + 1)
        mask[i, :n] = 1
        loss[i, 1:n] = 1
        adv[i, :n] = torch.arange(n) + 100 * (i + 1)
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss, "advantages": adv}


@pytest.mark.parametrize("sp", [1, 2, 4, 5])
def test_targets_are_shifted_on_the_unsliced_stream_and_no_shard_loses_one(sp):
    batch = wire_batch()
    shards = [pack_micro_batch(batch, sp_size=sp, sp_rank=r, device=CPU) for r in range(sp)]
    full = {k: torch.cat([s.local(k) for s in shards]) for k in ("targets", "loss_mask", "advantages", "position_ids")}
    total = 12
    assert shards[0].padded_len % sp == 0 and shards[0].padded_len >= total
    # Brute force: token t of sample i predicts token t+1 of sample i; the last predicts nothing.
    exp_targets, exp_mask, exp_adv, exp_pos = [], [], [], []
    for i, n in enumerate([4, 3, 5]):
        for t in range(n):
            last = t == n - 1
            exp_targets.append(0 if last else int(batch["input_ids"][i, t + 1]))
            exp_mask.append(0.0 if last else float(batch["loss_mask"][i, t + 1]))
            exp_adv.append(0.0 if last else float(batch["advantages"][i, t + 1]))
            exp_pos.append(t)
    assert full["targets"][:total].tolist() == exp_targets
    assert full["loss_mask"][:total].tolist() == exp_mask
    assert full["advantages"][:total].tolist() == exp_adv
    assert full["position_ids"][:total].tolist() == exp_pos
    assert full["loss_mask"].sum() == batch["loss_mask"].sum()  # nothing lost at shard edges
    assert full["loss_mask"][total:].sum() == 0


def test_unpack_restores_wire_alignment():
    batch = wire_batch()
    packed = pack_micro_batch(batch, sp_size=2, sp_rank=0, device=CPU)
    values = torch.arange(packed.padded_len, dtype=torch.float32) + 1
    out = packed.unpack(values)
    # out[i, t] = value at the packed position predicting token t (position of token t-1).
    starts = [0, 4, 7]
    for i, n in enumerate([4, 3, 5]):
        assert out[i, 0] == 0
        assert out[i, 1:n].tolist() == values[starts[i] : starts[i] + n - 1].tolist()
        assert out[i, n:].abs().sum() == 0


def test_empty_micro_batch_packs_to_sp_dummy_tokens():
    empty = {k: v[:0] for k, v in wire_batch().items()}
    packed = pack_micro_batch(empty, sp_size=4, sp_rank=3, device=CPU)
    assert packed.padded_len == 4 and packed.local("input_ids").shape == (1,)
    assert packed.tensors["loss_mask"].sum() == 0
    assert packed.cu_seqlens_padded.tolist() == [0, 4]


def test_malformed_attention_mask_names_the_sample():
    batch = wire_batch()
    batch["attention_mask"][1, 0] = 0
    with pytest.raises(MicroBatchError, match="sample 1"):
        pack_micro_batch(batch, sp_size=1, sp_rank=0, device=CPU)
    with pytest.raises(MicroBatchError, match="loss_mask"):
        pack_micro_batch({k: v for k, v in wire_batch().items() if k != "loss_mask"}, sp_size=1, sp_rank=0, device=CPU)


def test_roll_after_slice_control_loses_a_target_at_each_shard_edge():
    batch = wire_batch()
    good = [pack_micro_batch(batch, sp_size=2, sp_rank=r, device=CPU) for r in range(2)]
    bad = [pack_rolled_after_slice(batch, sp_size=2, sp_rank=r, device=CPU) for r in range(2)]
    assert sum(float(p.local("loss_mask").sum()) for p in good) == 9
    assert sum(float(p.local("loss_mask").sum()) for p in bad) < 9


@pytest.mark.parametrize("bug, packer", [("roll_after_slice", pack_rolled_after_slice), ("count_over_world", None)])
def test_faulty_engine_packs_through_the_engines_own_loop(bug, packer):
    """``FaultyTrainEngine._pack`` is the engine's loop with the control's pack function (the engine's
    own for every other bug): the same streams as calling that function per micro-batch."""
    from types import SimpleNamespace

    engine = FaultyTrainEngine.__new__(FaultyTrainEngine)  # no mesh needed: packing is per rank, no collective
    engine.bug, engine.layout, engine.device = bug, SimpleNamespace(sp=2, sp_rank=1), CPU
    micro_batches = [wire_batch(), wire_batch()]
    got = engine._pack(micro_batches, require_loss_mask=True)
    want = [(packer or pack_micro_batch)(mb, sp_size=2, sp_rank=1, device=CPU) for mb in micro_batches]
    other = [
        (pack_micro_batch if packer else pack_rolled_after_slice)(micro_batches[0], sp_size=2, sp_rank=1, device=CPU)
    ]
    assert len(got) == 2
    for g, w in zip(got, want):
        assert g.tensors.keys() == w.tensors.keys()
        assert all(torch.equal(g.tensors[k], w.tensors[k]) for k in w.tensors)
    # the two pack functions differ on this batch, so the comparison above tells them apart
    assert not torch.equal(other[0].tensors["loss_mask"], got[0].tensors["loss_mask"])
