"""GRPO / Dr.GRPO / RLOO outcome advantages against hand-computed values."""

import numpy as np
import pytest
import torch

from verl_balance.algorithms import (
    AdvantageInputError,
    compute_advantages,
    compute_grpo_outcome_advantage,
    group_outcome_advantages,
)

# Groups interleaved on purpose: a = [1, 2, 3] (mean 2, unbiased std 1), b = [5, 5] (std 0), c = [7] alone.
SCORES = torch.tensor([1.0, 5.0, 2.0, 7.0, 5.0, 3.0])
UIDS = np.array(["a", "b", "a", "c", "b", "a"], dtype=object)
EPS = 1e-6


def test_grpo_matches_hand_computed_values():
    adv = group_outcome_advantages(scores=SCORES, index=UIDS, estimator="grpo", epsilon=EPS)
    expected = torch.tensor([-1 / (1 + EPS), 0.0, 0.0, 0.0, 0.0, 1 / (1 + EPS)])
    torch.testing.assert_close(adv, expected)


def test_grpo_uses_unbiased_std_like_verl():
    scores = torch.tensor([0.0, 1.0, 1.0, 1.0])  # mean 0.75, unbiased var = 0.75 / 3 = 0.25 -> std 0.5
    adv = group_outcome_advantages(scores=scores, index=[0, 0, 0, 0], epsilon=0.0)
    torch.testing.assert_close(adv, torch.tensor([-1.5, 0.5, 0.5, 0.5]))


def test_drgrpo_only_subtracts_group_mean():
    adv = group_outcome_advantages(scores=SCORES, index=UIDS, estimator="grpo", norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 0.0, 0.0, 0.0, 1.0]))
    same = group_outcome_advantages(scores=SCORES, index=UIDS, estimator="drgrpo")
    torch.testing.assert_close(adv, same)


def test_rloo_subtracts_mean_of_the_other_responses():
    adv = group_outcome_advantages(scores=SCORES, index=UIDS, estimator="rloo")
    torch.testing.assert_close(adv, torch.tensor([1 - 2.5, 0.0, 2 - 2.0, 0.0, 0.0, 3 - 1.5]))


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_singleton_group_gets_zero_advantage(estimator):
    adv = group_outcome_advantages(scores=torch.tensor([3.0, 1.0, 4.0]), index=[0, 1, 2], estimator=estimator)
    assert torch.equal(adv, torch.zeros(3))


def test_advantages_do_not_depend_on_row_order():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(40, generator=gen)
    uids = np.arange(40) % 7
    perm = torch.randperm(40, generator=gen)
    base = group_outcome_advantages(scores=scores, index=uids)
    permuted = group_outcome_advantages(scores=scores[perm], index=uids[perm.numpy()])
    torch.testing.assert_close(permuted, base[perm])


def test_advantages_match_per_group_loop_reference():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(30, generator=gen)
    uids = (np.arange(30) * 7) % 6
    adv = group_outcome_advantages(scores=scores, index=uids, epsilon=EPS)
    for g in np.unique(uids):
        rows = np.flatnonzero(uids == g)
        values = scores[rows].double()
        expected = (values - values.mean()) / (values.std() + EPS)
        torch.testing.assert_close(adv[rows], expected.float())


def test_token_aligned_broadcast_is_zero_outside_loss_mask():
    loss_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1], [0, 0, 0, 1, 0]])
    adv = compute_grpo_outcome_advantage(
        scores=[0.0, 1.0, 2.0], index=["p", "p", "p"], loss_mask=loss_mask, epsilon=0.0
    )
    expected = torch.tensor([[0, 0, -1, -1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.float32)
    torch.testing.assert_close(adv, expected)
    assert adv.dtype == torch.float32


def test_invalid_inputs_raise_value_errors_naming_the_problem():
    with pytest.raises(AdvantageInputError, match="samples \\[1\\]"):
        group_outcome_advantages(scores=[1.0, float("nan")], index=[0, 0])
    with pytest.raises(AdvantageInputError, match="index must have shape"):
        group_outcome_advantages(scores=[1.0, 2.0], index=[0])
    with pytest.raises(AdvantageInputError, match="adv_estimator='gae'"):
        compute_advantages(adv_estimator="gae", scores=[1.0], index=[0], loss_mask=torch.ones(1, 2))
    with pytest.raises(AdvantageInputError, match="one score per row"):
        compute_advantages(adv_estimator="grpo", scores=[1.0, 2.0], index=[0, 0], loss_mask=torch.ones(3, 2))
