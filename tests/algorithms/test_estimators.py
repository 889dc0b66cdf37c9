"""The adv_estimator registry without verl: hand-worked examples, independent properties, and errors
that name the key (tests/algorithms/test_estimators_verl.py compares each with verl's own)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.algorithms.estimator_inputs import AdvantageInputs, AdvantageParams
from verl_balance.algorithms.estimators import ADV_ESTIMATOR_REGISTRY, check_estimator, compute_advantage
from verl_balance.algorithms.group_stats import AdvantageInputError

VERL_ESTIMATORS = {
    "gae",
    "grpo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
    "opo",
    "grpo_passk",
    "gpg",
    "rloo_vectorized",
    "grpo_vectorized",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
    "gdpo",
}


def outcome_batch(scores, lengths, uids, *, prompt=2, width=None):
    """Rows with `prompt` prompt tokens, then the response, the score on its last token."""
    width = width or prompt + max(lengths) + 1
    mask = torch.zeros(len(scores), width)
    rewards = torch.zeros(len(scores), width)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, prompt : prompt + n] = 1
        if n:
            rewards[i, prompt + n - 1] = s
    return AdvantageInputs(token_level_rewards=rewards, response_mask=mask, index=np.asarray(uids, dtype=object))


def run(name, inputs, **params):
    return compute_advantage(adv_estimator=name, inputs=inputs, params=AdvantageParams(**params))


def per_row(out, inputs):
    """The advantage of each row's first response token."""
    first = inputs.response_mask.argmax(-1)
    return out.advantages[torch.arange(len(first)), first]


def test_registry_holds_verls_estimators_and_drgrpo():
    assert set(ADV_ESTIMATOR_REGISTRY) == VERL_ESTIMATORS | {"drgrpo"}
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason=VERL_SKIP_REASON)
    assert {e.value for e in core_algos.AdvantageEstimator} == VERL_ESTIMATORS


def test_unknown_estimator_names_the_key():
    with pytest.raises(AdvantageInputError, match=r"algorithm\.adv_estimator='ppo'.*valid"):
        check_estimator("ppo", available=["index"])


@pytest.mark.parametrize(
    "name, missing",
    [
        ("gae", "values"),
        ("remax", "reward_baselines"),
        ("grpo", "index"),
        ("optimal_token_baseline", "sum_pi_squared"),
        ("tir_optimal_token_baseline", "old_log_probs"),
    ],
)
def test_missing_input_fails_at_start_up_naming_the_key(name, missing):
    everything = {"index", "values", "reward_baselines", "old_log_probs", "sum_pi_squared"}
    check_estimator(name, available=everything)
    with pytest.raises(AdvantageInputError, match=rf"algorithm\.adv_estimator='{name}' needs \['{missing}'\]"):
        check_estimator(name, available=everything - {missing})


def test_gdpo_with_reward_keys_needs_the_components():
    params = AdvantageParams(gdpo_reward_keys=["fmt", "acc"])
    check_estimator("gdpo", available={"index"})
    with pytest.raises(AdvantageInputError, match="reward_components"):
        check_estimator("gdpo", available={"index"}, params=params)
    inputs = outcome_batch([1.0, 0.0], [2, 2], ["a", "a"])
    inputs = AdvantageInputs(**{**inputs.__dict__, "reward_components": {"fmt": torch.ones(2)}})
    with pytest.raises(AdvantageInputError, match=r"algorithm\.gdpo_reward_keys names \['acc'\]"):
        compute_advantage(adv_estimator="gdpo", inputs=inputs, params=params)


def test_passk_needs_two_responses_per_prompt():
    inputs = outcome_batch([1.0, 2.0, 3.0], [1, 1, 1], ["a", "a", "b"])
    with pytest.raises(AdvantageInputError, match=r"grpo_passk.*uid 'b'.*has 1"):
        run("grpo_passk", inputs)


def test_rloo_is_n_over_n_minus_1_times_centered_score():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(12, generator=gen).tolist()
    uids = [i % 3 for i in range(12)]  # groups of 4
    inputs = outcome_batch(scores, [2] * 12, uids)
    s = torch.tensor(scores, dtype=torch.float64)
    means = torch.stack([s[[j for j in range(12) if uids[j] == uids[i]]].mean() for i in range(12)])
    expected = (4 / 3 * (s - means)).float()
    for name in ("rloo", "rloo_vectorized"):
        torch.testing.assert_close(per_row(run(name, inputs), inputs), expected)


def test_grpo_vectorized_keeps_our_singleton_convention():
    inputs = outcome_batch([1.0, 2.0, 5.0], [1, 1, 1], ["a", "a", "alone"])
    adv = per_row(run("grpo_vectorized", inputs), inputs)
    assert adv[2] == 0 and adv[0] < 0 < adv[1]


def test_opo_uses_a_length_weighted_baseline():
    # group a: scores 1 and 3 with 1 and 3 tokens: baseline (1*1 + 3*3) / 4 = 2.5; b alone: baseline 0.
    inputs = outcome_batch([1.0, 3.0, 4.0], [1, 3, 2], ["a", "a", "b"])
    torch.testing.assert_close(per_row(run("opo", inputs), inputs), torch.tensor([-1.5, 0.5, 4.0]))


def test_passk_pushes_only_the_best_response_by_its_margin():
    inputs = outcome_batch([1.0, 4.0, 2.0, 3.0, 3.0, 0.0], [1] * 6, ["a", "a", "a", "b", "b", "b"])
    plain = per_row(run("grpo_passk", inputs, norm_adv_by_std_in_grpo=False), inputs)
    torch.testing.assert_close(plain, torch.tensor([0.0, 2.0, 0.0, 0.0, 0.0, 0.0]))  # a tie at the top: margin 0
    normed = per_row(run("grpo_passk", inputs, epsilon=0.0), inputs)
    assert normed[1].item() == pytest.approx(2.0 / math.sqrt(7 / 3), rel=1e-6)


def test_gpg_scales_by_batch_over_nonzero_scores():
    inputs = outcome_batch([2.0, 0.0, 4.0, 0.0], [1] * 4, ["g"] * 4)  # alpha = 4 / 2, mean 1.5
    torch.testing.assert_close(per_row(run("gpg", inputs), inputs), torch.tensor([1.0, -3.0, 5.0, -3.0]))


def test_remax_subtracts_the_greedy_reward_from_the_reward_to_go():
    inputs = outcome_batch([2.0, -1.0], [3, 2], ["a", "b"])
    inputs = AdvantageInputs(**{**inputs.__dict__, "reward_baselines": torch.tensor([0.5, 1.0])})
    out = run("remax", inputs)
    mask = inputs.response_mask > 0
    torch.testing.assert_close(out.advantages[0][mask[0]], torch.full((3,), 1.5))
    torch.testing.assert_close(out.advantages[1][mask[1]], torch.full((2,), -2.0))
    torch.testing.assert_close(out.returns[0][mask[0]], torch.full((3,), 2.0))


def test_reinforce_plus_plus_discounts_then_whitens():
    inputs = outcome_batch([1.0, 2.0], [3, 1], ["a", "b"])
    out = run("reinforce_plus_plus", inputs, gamma=0.5)
    mask = inputs.response_mask > 0
    torch.testing.assert_close(out.returns[mask], torch.tensor([0.25, 0.5, 1.0, 2.0]))
    adv = out.advantages[mask].double()
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert adv.var().item() == pytest.approx(1.0, rel=1e-6)  # unbiased, as verl's masked_whiten


def test_whitened_estimators_have_zero_mean_unit_variance_on_response_tokens():
    gen = torch.Generator().manual_seed(1)
    inputs = outcome_batch(torch.randn(9, generator=gen).tolist(), [1, 2, 3] * 3, [i // 3 for i in range(9)])
    for name in ("reinforce_plus_plus_baseline", "gdpo"):
        adv = run(name, inputs).advantages[inputs.response_mask > 0].double()
        assert adv.mean().item() == pytest.approx(0.0, abs=1e-6), name
        assert adv.var().item() == pytest.approx(1.0, rel=1e-5), name


def _otb_inputs(lengths, scores, uids):
    inputs = outcome_batch(scores, lengths, uids)
    old = torch.full_like(inputs.response_mask, math.log(0.3))
    # w_t = 1 - 2 pi + sum_pi^2 = 1 at every token: W_t counts the response tokens up to t.
    return AdvantageInputs(**{**inputs.__dict__, "old_log_probs": old, "sum_pi_squared": 2 * old.exp()})


def test_optimal_token_baseline_with_equal_path_variance_is_the_group_mean():
    inputs = _otb_inputs([2, 2], [1.0, 3.0], ["g", "g"])
    for name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        adv = run(name, inputs).advantages[inputs.response_mask > 0]
        torch.testing.assert_close(adv, torch.tensor([-1.0, -1.0, 1.0, 1.0]))


def test_optimal_token_baseline_zero_tail():
    # Lengths 1 and 3: the single longest response has no baseline from position 1 on.
    inputs = _otb_inputs([1, 3], [1.0, 3.0], ["g", "g"])
    mask = inputs.response_mask > 0
    cut = run("optimal_token_baseline", inputs).advantages[1][mask[1]]
    torch.testing.assert_close(cut, torch.tensor([3.0 - (1 * 1 + 3 * 1) / 2, 3.0, 3.0]))
    kept = run("optimal_token_baseline", inputs, otb_handle_zero_tail=False).advantages[1][mask[1]]
    torch.testing.assert_close(kept, torch.tensor([1.0, 0.0, 0.0]))  # position 1, 2: only this row, B = G


def test_gdpo_without_keys_is_whitened_grpo():
    gen = torch.Generator().manual_seed(2)
    inputs = outcome_batch(torch.randn(8, generator=gen).tolist(), [2, 3] * 4, [i // 4 for i in range(8)])
    grpo = run("grpo", inputs).advantages.double()
    mask = inputs.response_mask > 0
    expected = (grpo[mask] - grpo[mask].mean()) / grpo[mask].std()
    torch.testing.assert_close(run("gdpo", inputs).advantages[mask].double(), expected, rtol=1e-5, atol=1e-6)


def _random_batch(seed, rows=10):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 6, (rows,), generator=gen).tolist()
    inputs = outcome_batch(torch.randn(rows, generator=gen).tolist(), lengths, [i % 3 for i in range(rows)])
    shape = inputs.response_mask.shape
    return AdvantageInputs(
        **{
            **inputs.__dict__,
            "values": torch.randn(shape, generator=gen),
            "old_log_probs": -torch.rand(shape, generator=gen),
            "sum_pi_squared": torch.rand(shape, generator=gen) * 0.5,
            "reward_baselines": torch.randn(rows, generator=gen),
        }
    )


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATOR_REGISTRY))
def test_every_estimator_is_zero_off_the_mask_and_independent_of_row_order(name):
    inputs = _random_batch(3)
    out = run(name, inputs)
    assert out.advantages.dtype == torch.float32 and out.advantages.shape == inputs.response_mask.shape
    assert (out.advantages[inputs.response_mask == 0] == 0).all()
    perm = torch.randperm(len(inputs.index), generator=torch.Generator().manual_seed(4))
    permuted = AdvantageInputs(
        **{
            k: (v[perm] if isinstance(v, torch.Tensor) else v[perm.numpy()] if isinstance(v, np.ndarray) else v)
            for k, v in inputs.__dict__.items()
        }
    )
    torch.testing.assert_close(run(name, permuted).advantages, out.advantages[perm], rtol=1e-5, atol=1e-6)


def test_bad_shapes_name_the_input():
    inputs = _random_batch(5)
    bad = AdvantageInputs(**{**inputs.__dict__, "values": inputs.values[:, :-1]})
    with pytest.raises(AdvantageInputError, match="values has shape"):
        run("gae", bad)
    bad = AdvantageInputs(**{**inputs.__dict__, "reward_baselines": torch.zeros(3)})
    with pytest.raises(AdvantageInputError, match="reward_baselines"):
        run("remax", bad)
    bad = AdvantageInputs(**{**inputs.__dict__, "index": np.arange(3)})
    with pytest.raises(AdvantageInputError, match="index must have shape"):
        run("opo", bad)
