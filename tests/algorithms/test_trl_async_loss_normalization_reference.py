"""TRL's async-GRPO loss-normalisation tests, run against our loss contract (PPO loss, packing, weights).

Adapts ``tests/experimental/test_async_loss_normalization.py`` of huggingface/trl at commit
6333b4a13b12a494e78fb75360b3b65abbf77fdc. TRL's ``AsyncGRPOTrainer`` divides each micro-batch's
token sum of the PPO-clip loss by the accumulation window's global token count over the world size;
its tests check that splitting one batch into micro-batches or ranks changes neither the loss nor
the gradients. Here the same samples, token-local toy model and expectations run through what our
engine runs per micro-batch: the wire rows packed by ``engine.packing.pack_micro_batch``, the
per-token ``algorithms.policy_loss.PPOLoss`` (clip 0.2 both sides, no dual clip: TRL's loss),
``loss.compute_token_weights`` with ``token-mean`` over the step's micro-batches, and a backward of
G * sum(w * l) per micro-batch (G = the number of ranks FSDP averages over). Several DP ranks are one
weights call over all their micro-batches, which is what the DP group's all-reduce SUM of the counts
gives. TRL's "final, shorter accumulation window" (4 batches asked, 2 there) is a step whose plan has
empty micro-batches (a balanced plan gives every rank the same count). Every case also checks the
hand-worked value: at the start lm_head is 0, so every ratio is 1, the loss is -sum(A_i n_i) / N and
d loss / d lm_head = loss * [[-1/2, -1/2], [1/2, 1/2]] (the embedding gets no gradient).

Adapted (GRPO fixture): ``test_accumulated_gradients_match_full_batch`` (8 cases),
``test_window_token_count``, ``test_rank_average_matches_full_batch`` (2); all pass.
Left out: every ``distillation`` case (TRL's ``AsyncDistillationTrainer``, a teacher top-k loss we do
not have); ``test_aux_loss_keeps_its_scale`` (a MoE router auxiliary loss, which our loss has not);
``test_trainer_optimizer_step_matches_full_batch`` (HF ``Trainer``'s loop with SGD; our optimizer step
is ``TrainEngine.optimizer_step``, whose parameters after one step the parity matrix checks per layout).
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_balance.algorithms.policy_loss import PolicyLossConfig, PPOLoss
from verl_balance.batch_keys import (
    ADVANTAGES_KEY,
    ATTENTION_MASK_KEY,
    INPUT_IDS_KEY,
    LOSS_MASK_KEY,
    OLD_LOG_PROBS_KEY,
    POSITION_IDS_KEY,
)
from verl_balance.engine.packing import PackedMicroBatch, pack_micro_batch
from verl_balance.loss import compute_token_weights

CPU = torch.device("cpu")
PPO = PPOLoss(PolicyLossConfig(clip_ratio=0.2, clip_ratio_c=None), report_entropy=False)


class _TokenModel(torch.nn.Module):
    """Token-local (each log-prob depends on its own token only), so packing cannot change the reference."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(2, 2)
        torch.nn.init.ones_(self.embed.weight)
        self.lm_head = torch.nn.Linear(2, 2, bias=False)
        torch.nn.init.zeros_(self.lm_head.weight)

    def forward(self, packed: PackedMicroBatch) -> torch.Tensor:
        """Target-aligned log-probs of the packed stream (log p(target_p | token_p))."""
        log_probs = self.lm_head(self.embed(packed.tensors[INPUT_IDS_KEY])).log_softmax(-1)
        return log_probs.gather(-1, packed.tensors["targets"][:, None]).squeeze(-1)


def _sample(n_tokens, advantage):
    """Two prompt tokens and an internal context token, none of them trained on (loss mask 0)."""
    mask = [0, 0] + [1] * (n_tokens // 2) + [0] + [1] * (n_tokens - n_tokens // 2)
    return {"mask": mask, "advantage": advantage}


def _micro_batch(samples) -> dict[str, torch.Tensor]:
    """Right-padded wire rows (docs/design.md's wire format); no samples = an empty micro-batch."""
    width = max([len(s["mask"]) for s in samples] + [1])
    rows = {k: torch.zeros(len(samples), width) for k in (LOSS_MASK_KEY, OLD_LOG_PROBS_KEY, ADVANTAGES_KEY)}
    attention = torch.zeros(len(samples), width, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["mask"])
        attention[i, :n] = 1
        rows[LOSS_MASK_KEY][i, :n] = torch.tensor(s["mask"], dtype=torch.float32)
        rows[OLD_LOG_PROBS_KEY][i, :n] = -math.log(2)
        rows[ADVANTAGES_KEY][i, :n] = s["advantage"]
    positions = (torch.arange(width)[None, :] * attention).long()
    return {INPUT_IDS_KEY: attention.clone(), ATTENTION_MASK_KEY: attention, POSITION_IDS_KEY: positions, **rows}


def _pack(micro_batch, *, sp_size=1, sp_rank=0) -> PackedMicroBatch:
    return pack_micro_batch(micro_batch, sp_size=sp_size, sp_rank=sp_rank, device=CPU)


def _weights(packed):
    return compute_token_weights(
        loss_masks=[p.tensors[LOSS_MASK_KEY] for p in packed],
        cu_seqlens=[p.cu_seqlens_host for p in packed],
        agg_mode="token-mean",
        dp_group=None,
    )


def _step(model, ranks, *, dp_reduced=True):
    """One optimizer step's backward on each rank (lists of wire micro-batches): each rank's backward loss
    G * J_r, its gradients, and the counts. ``dp_reduced=False``: each rank counts only its own tokens."""
    packed = [[_pack(mb) for mb in rank] for rank in ranks]
    if dp_reduced:
        every = _weights([p for rank in packed for p in rank])
        it = iter(every.weights)
        weights = [[next(it) for _ in rank] for rank in packed]
    else:
        weights = [_weights(rank).weights for rank in packed]
        every = None
    grad_scale = len(ranks)
    losses, grads = [], []
    for rank, rank_weights in zip(packed, weights):
        model.zero_grad()
        objective = torch.zeros(())
        for p, w in zip(rank, rank_weights):
            loss, _ = PPO(log_probs=model(p), entropy=None, inputs=p.local_inputs())
            mb_objective = (w * loss).sum()
            (grad_scale * mb_objective).backward()
            objective = objective + mb_objective.detach()
        losses.append(grad_scale * objective)
        grads.append({name: param.grad.clone() for name, param in model.named_parameters()})
    return losses, grads, every


def _by_hand(samples):
    """(loss, {parameter: gradient}) of the whole batch at the start (see the module docstring)."""
    tokens = sum(sum(s["mask"]) for s in samples)
    loss = -sum(s["advantage"] * sum(s["mask"]) for s in samples) / max(tokens, 1)
    lm_head = loss * torch.tensor([[-0.5, -0.5], [0.5, 0.5]])
    return torch.tensor(loss), {"embed.weight": torch.zeros(2, 2), "lm_head.weight": lm_head}


def _assert_grads(grads, reference):
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name])


@pytest.mark.parametrize("token_counts", [(100, 900), (100, 100), (0, 9), (0, 0)])
@pytest.mark.parametrize("num_batches", [2, 4])
def test_accumulated_gradients_match_full_batch(token_counts, num_batches):
    model = _TokenModel()
    samples = [_sample(token_counts[0], -2.0), _sample(token_counts[1], -0.5)]
    (reference_loss,), (reference_grads,), _ = _step(model, [[_micro_batch(samples)]])
    window = [_micro_batch([s]) for s in samples] + [_micro_batch([])] * (num_batches - len(samples))
    (loss,), (grads,), counts = _step(model, [window])

    torch.testing.assert_close(loss, reference_loss)
    _assert_grads(grads, reference_grads)
    assert counts.num_tokens == sum(token_counts)
    hand_loss, hand_grads = _by_hand(samples)
    torch.testing.assert_close(reference_loss, hand_loss)
    _assert_grads(reference_grads, hand_grads)


def test_window_token_count():
    """A step's count is the sum over its own micro-batches, and every SP rank of a DP rank counts the
    same full sequences (the count is reduced over DP only, never again over SP)."""
    micro_batches = [_micro_batch([_sample(n, 1.0)]) for n in (100, 900, 50)]
    windows = [micro_batches[:2], micro_batches[2:], []]
    expected = [1000, 50, 0]
    for window, count in zip(windows, expected):
        for sp_rank in (0, 1):
            counts = _weights([_pack(mb, sp_size=2, sp_rank=sp_rank) for mb in window])
            assert counts.num_tokens == count
            assert len(counts.weights) == len(window)


@pytest.mark.parametrize("token_counts", [((1, 3), (4, 12)), ((0, 0), (0, 1))])
def test_rank_average_matches_full_batch(token_counts):
    """Two DP ranks; FSDP averages their gradients (and G = 2 scales each rank's backward)."""
    model = _TokenModel()
    samples = [[_sample(c, -2.0 if i == 0 else -0.5) for c in counts] for i, counts in enumerate(token_counts)]
    all_samples = [s for batch in samples for s in batch]
    (reference_loss,), (reference_grads,), _ = _step(model, [[_micro_batch(all_samples)]])
    # Micro-batch i of rank r is row r of global batch i (one sample each), as TRL's dispatcher scatters.
    ranks = [[_micro_batch([batch[r]]) for batch in samples] for r in range(2)]
    rank_losses, rank_grads, counts = _step(model, ranks)

    torch.testing.assert_close(sum(rank_losses) / 2, reference_loss)
    for name in reference_grads:
        torch.testing.assert_close(sum(g[name] for g in rank_grads) / 2, reference_grads[name])
    assert counts.num_tokens == sum(sum(c) for c in token_counts)
    torch.testing.assert_close(reference_loss, _by_hand(all_samples)[0])
    if token_counts == ((1, 3), (4, 12)):  # negative control: ranks with 5 and 15 tokens, each counting its own
        local_losses, _, _ = _step(model, ranks, dp_reduced=False)
        assert not torch.allclose(sum(local_losses) / 2, reference_loss)
