"""clip_cov / kl_cov's mini-batch-wide token selection (algorithms/batch_selection.py) on one process.

- With the whole mini-batch as one micro-batch the loss equals verl 0.9.1's function (value and gradient,
  rtol 1e-6, float64); clip_cov with k >= its candidates, where verl's random draw keeps every one.
- Cut into several micro-batches (and fed in any order) the selection is the same tokens: the statistics
  are the mini-batch's. Negative control: selecting per micro-batch (verl's layout-dependent statistics)
  gives another selection.
- select_smallest on a simulated world of several ranks picks exactly k tokens, the k smallest keys.
"""

from __future__ import annotations

import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from tests.algorithms.test_loss_modes_verl import CONFIG, make_inputs, verl_objective
from verl_balance.algorithms.batch_selection import covariance_selections, select_smallest, token_hash_keys
from verl_balance.algorithms.loss_modes import LossModeConfig, policy_token_loss
from verl_balance.loss import compute_token_weights

MODES = {
    "kl_cov": LossModeConfig(loss_mode="kl_cov", kl_cov_ratio=0.1, ppo_kl_coef=0.5),
    # ratio 0.5: k exceeds the candidates, so verl's random draw keeps all of them
    "clip_cov": LossModeConfig(loss_mode="clip_cov", clip_cov_ratio=0.5, clip_cov_lb=0.5, clip_cov_ub=5.0),
}
KEYS = {"kl_cov": "kl_cov_select", "clip_cov": "clip_cov_drop"}


def _one_world():
    return {"world_sum": lambda t: t, "world_gather": lambda t: (t, 0)}


def _select(d, mode, rows_per_micro: int | None = None, *, per_micro: bool = False):
    """The selection over the (B, L) rows, cut into micro-batches of ``rows_per_micro`` rows: each
    row is one sequence (positions 0..L-1, token ids from the row index)."""
    rows = len(d["mask"])
    cuts = [(i, min(i + (rows_per_micro or rows), rows)) for i in range(0, rows, rows_per_micro or rows)]
    ids = torch.arange(rows)[:, None].expand_as(d["mask"])
    positions = torch.arange(d["mask"].shape[1])[None, :].expand_as(d["mask"])

    def run(parts):
        return covariance_selections(
            log_probs=[d["log_probs"][a:b] for a, b in parts],
            old_log_probs=[d["old"][a:b] for a, b in parts],
            advantages=[d["adv"][a:b] for a, b in parts],
            loss_masks=[d["mask"][a:b] for a, b in parts],
            hash_keys=lambda i: token_hash_keys(
                ids[parts[i][0] : parts[i][1]].double(), positions[: parts[i][1] - parts[i][0]], seed=3
            ),
            num_tokens=int(sum(d["mask"][a:b].sum() for a, b in parts)),
            config=CONFIG,
            mode=mode,
            **_one_world(),
        )

    if per_micro:  # verl's statistics: each micro-batch on its own
        return torch.cat([run([c])[0][KEYS[mode.loss_mode]] for c in cuts])
    return torch.cat([s[KEYS[mode.loss_mode]] for s in run(cuts)])


def _objective(d, mode, selection):
    log_probs = d["log_probs"].clone().requires_grad_(True)
    loss, _ = policy_token_loss(
        log_probs=log_probs,
        old_log_probs=d["old"],
        advantages=d["adv"],
        config=CONFIG,
        mode=mode,
        reduced={KEYS[mode.loss_mode]: selection},
    )
    rows, width = d["mask"].shape
    weights = compute_token_weights(
        loss_masks=[d["mask"].flatten()],
        cu_seqlens=[torch.arange(rows + 1) * width],
        agg_mode="token-mean",
        loss_scale_factor=float(width),
        dp_group=None,
    ).weights[0]
    objective = (weights.view(rows, width).double() * loss).sum()
    objective.backward()
    return objective.detach(), log_probs.grad


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(MODES))
def test_whole_mini_batch_selection_equals_verls_loss(name, seed):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason=VERL_SKIP_REASON)
    d = make_inputs(seed)
    selection = _select(d, MODES[name])
    assert 2 <= selection.sum() < d["mask"].sum()  # the cases exercise the selection
    ours = _objective(d, MODES[name], selection)
    ref = verl_objective(core_algos, d, CONFIG, MODES[name], "token-mean", seed=seed)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", sorted(MODES))
def test_selection_over_several_micro_batches_is_the_whole_mini_batches_and_per_micro_batch_is_not(name):
    mode = MODES[name]
    d = make_inputs(2, rows=12)
    whole = _select(d, mode)
    for rows_per_micro in (1, 3, 5):
        assert torch.equal(_select(d, mode, rows_per_micro), whole), rows_per_micro
    # negative control: verl's per-micro-batch statistics select other tokens
    assert not torch.equal(_select(d, mode, 3, per_micro=True), whole)


def test_clip_cov_draw_of_fewer_than_the_candidates_is_k_tokens_independent_of_the_cut():
    mode = LossModeConfig(loss_mode="clip_cov", clip_cov_ratio=0.02, clip_cov_lb=0.0, clip_cov_ub=50.0)
    d = make_inputs(4, rows=12)
    whole = _select(d, mode)
    assert whole.sum() == max(int(0.02 * d["mask"].sum()), 1)
    assert torch.equal(_select(d, mode, 2), whole)


def test_select_smallest_over_a_simulated_world_takes_exactly_k_smallest_with_ties():
    gen = torch.Generator().manual_seed(0)
    per_rank = [torch.randint(0, 6, (n,), generator=gen) for n in (5, 0, 7, 4)]
    valid = [torch.rand(len(k), generator=gen) < 0.8 for k in per_rank]
    every = torch.cat([k[v] for k, v in zip(per_rank, valid)])
    for k in (1, 4, 7, len(every), len(every) + 3):
        picked = []
        local_k = []
        for rank in range(len(per_rank)):  # each rank's view: gathers of every rank's contribution

            def gather(t, rank=rank, kk=k):
                parts = []
                for r in range(len(per_rank)):
                    if t.dtype == torch.float64:  # the tie counts
                        parts.append(torch.tensor([float((per_rank[r][valid[r]] == threshold_of(kk)).sum())]))
                    else:
                        flat = torch.sort(per_rank[r][valid[r]]).values[:kk]
                        pad = torch.iinfo(flat.dtype).max
                        parts.append(torch.cat([flat, flat.new_full((kk - len(flat),), pad)]))
                return torch.cat(parts), rank

            def world_sum(t, kk=k):
                thr = threshold_of(kk)
                t[0] = float((every < thr).sum())
                t[1] = float((every == thr).sum())
                return t

            def threshold_of(kk):
                padded = torch.cat([every, every.new_full((len(per_rank) * kk,), torch.iinfo(every.dtype).max)])
                return torch.sort(padded).values[kk - 1]

            out = select_smallest([per_rank[rank]], [valid[rank]], k=k, world_sum=world_sum, world_gather=gather)
            picked.append(per_rank[rank][out[0]])
            local_k.append(int(out[0].sum()))
        got = torch.sort(torch.cat(picked)).values
        assert torch.equal(got, torch.sort(every).values[: min(k, len(every))]), k
