"""verl's CPU tests of its core algorithms, run against our estimators, registry and KL estimators.

Adapts ``tests/trainer/ppo/test_core_algos_on_cpu.py`` of verl-project/verl at commit
1dda039b9c6311889a9c9a26040677e1254814f9 (the file as last changed in 1cc810c1). Where a case
calls verl's ``core_algos`` we call ours: ``estimators.compute_advantage`` with the same estimator
name, ``estimators.estimator_spec`` for ``get_adv_estimator_fn``, and the in-reward KL
(``kl_in_reward.apply_kl_in_reward``, the one place our code takes verl's ``+`` spellings) for
``kl_penalty``. verl checks its loop implementations against its vectorised twins; both of our
names run one vectorised function, so the cases compare each with a per-group loop written here
from the estimator's definition. The upstream data come from unseeded global generators; here each
case seeds its own generator.

Left out (features we do not have):
- the six ``TestRegisterAdvEst`` cases of ``register_adv_est`` (registering a function, an enum
  name, same / different function twice, the decorator's return value, several registrations):
  our registry is verl's fixed set of names, with no registration decorator;
- ``test_kl_penalty_k3_plus_uses_k2_gradient``: the straight-through ``+`` estimators of the
  actor's KL loss; ``actor.kl_loss_type="k3+"`` is refused at configuration
  (``test_straight_through_kl_loss_is_refused_naming_the_valid_types`` pins the refusal).
"""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest
import torch

from verl_balance.algorithms import outcome_estimators, token_estimators
from verl_balance.algorithms.estimator_inputs import AdvantageInputs, AdvantageParams
from verl_balance.algorithms.estimators import compute_advantage, estimator_spec
from verl_balance.algorithms.kl import KLEstimatorError
from verl_balance.algorithms.kl_in_reward import KLController, apply_kl_in_reward
from verl_balance.algorithms.policy_loss import PolicyLossConfig


# ---------------------------------------------------------------- the estimator registry (get_adv_estimator_fn)
def test_get_adv_estimator_fn_valid_names():
    assert estimator_spec("gae").fn is token_estimators.gae
    assert estimator_spec("grpo").fn is outcome_estimators.grpo


def test_get_adv_estimator_fn_invalid_name():
    with pytest.raises(ValueError, match="invalid_name"):
        estimator_spec("invalid_name")


def test_get_adv_estimator_fn_case_sensitive():
    with pytest.raises(ValueError):
        estimator_spec("GAE")


# ---------------------------------------------------------------- GAE skips observation tokens
def _gae(rewards, values, mask, gamma, lam):
    inputs = AdvantageInputs(token_level_rewards=rewards, response_mask=mask, values=values)
    return compute_advantage(adv_estimator="gae", inputs=inputs, params=AdvantageParams(gamma=gamma, lam=lam))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multi_turn_compute_gae_advantage_return(seed):
    """Values on observation tokens (mask 0) do not change the advantages or the masked returns."""
    rng = random.Random(seed)
    gamma, lam = rng.uniform(0.0, 1.0), rng.uniform(0.0, 1.0)
    rewards = torch.tensor([[0.0, 0.0, 0.1, 0.1, 0.1, 0.0, 0.0, 0.1, 1.0, 0.0, 0.0]])
    tail = [7.0, 9.0, 0.0, 0.0]
    values1 = [rng.uniform(-100.0, 100.0), rng.random(), 4.0, 5.0, 6.0, rng.uniform(-100.0, 0), rng.random()]
    values2 = [rng.random(), rng.uniform(-100.0, 100.0), 4.0, 5.0, 6.0, rng.random(), rng.uniform(0.0, 100.0)]
    values1, values2 = torch.tensor([values1 + tail]), torch.tensor([values2 + tail])
    response_mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0]], dtype=torch.float)

    adv1, ret1 = _gae(rewards, values1, response_mask, gamma, lam)
    adv2, ret2 = _gae(rewards, values2, response_mask, gamma, lam)

    assert torch.equal(adv1, adv2), f"{adv1=}, {adv2=}"
    assert torch.equal(ret1 * response_mask, ret2 * response_mask), f"{ret1=}, {ret2=}"
    # Negative control: a value on a response token does change them.
    values3 = values2.clone()
    values3[0, 3] += 1.0
    adv3, _ = _gae(rewards, values3, response_mask, gamma, lam)
    assert not torch.equal(adv1, adv3)


# ---------------------------------------------------------------- RLOO / GRPO against per-group loops
def _make_group_index(rng: random.Random, batch_size: int, num_groups: int) -> np.ndarray:
    """Group labels with at least 2 rows per group, shuffled."""
    counts = [2] * num_groups
    for _ in range(batch_size - 2 * num_groups):
        counts[rng.randrange(num_groups)] += 1
    index = [gid for gid, c in enumerate(counts) for _ in range(c)]
    rng.shuffle(index)
    return np.asarray(index, dtype=np.int64)


def _rand_mask(gen: torch.Generator, batch_size: int, seq_len: int) -> torch.Tensor:
    mask = torch.randint(0, 2, (batch_size, seq_len), generator=gen).float()
    mask[mask.sum(-1) == 0, -1] = 1.0
    return mask


def _random_case(batch_size, seq_len, num_groups, seed):
    gen = torch.Generator().manual_seed(seed)
    index = _make_group_index(random.Random(seed), batch_size, num_groups)
    response_mask = _rand_mask(gen, batch_size, seq_len)
    token_level_rewards = torch.randn(batch_size, seq_len, generator=gen) * response_mask
    return token_level_rewards, response_mask, index


def _loop_reference(token_level_rewards, response_mask, index, estimator, epsilon=1e-6):
    """Per-group loop from the definitions: rloo a_i = r_i - mean of the group's other scores; grpo
    a_i = (r_i - mean_g) / (sample std_g + epsilon); r_i the row's summed token rewards."""
    scores = token_level_rewards.double().sum(-1).tolist()
    groups: dict = {}
    for i, g in enumerate(index):
        groups.setdefault(g, []).append(i)
    adv = [0.0] * len(scores)
    for rows in groups.values():
        group = [scores[i] for i in rows]
        mean, n = statistics.fmean(group), len(group)
        for i in rows:
            if estimator == "rloo":
                adv[i] = scores[i] - (mean * n - scores[i]) / (n - 1)
            else:
                adv[i] = (scores[i] - mean) / (statistics.stdev(group) + epsilon)
    return torch.tensor(adv, dtype=torch.float64)[:, None] * response_mask.double()


def _ours(name, token_level_rewards, response_mask, index):
    inputs = AdvantageInputs(token_level_rewards=token_level_rewards, response_mask=response_mask, index=index)
    return compute_advantage(adv_estimator=name, inputs=inputs, params=AdvantageParams())


CASES = [(64, 128, 5, 0), (128, 256, 8, 1), (512, 512, 10, 2)]


@pytest.mark.parametrize("batch_size,seq_len,num_groups,seed", CASES)
def test_rloo_and_vectorized_equivalence(batch_size, seq_len, num_groups, seed):
    rewards, mask, index = _random_case(batch_size, seq_len, num_groups, seed)
    expected = _loop_reference(rewards, mask, index, "rloo").float()
    for name in ("rloo", "rloo_vectorized"):
        adv, ret = _ours(name, rewards, mask, index)
        assert adv.shape == ret.shape == (batch_size, seq_len)
        torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ret, expected, rtol=1e-5, atol=1e-6)


def test_grpo_vectorized_matches_original_for_low_variance_rewards():
    """Two responses 1e-5 apart: the group statistics must not cancel (float32 inputs, exact here)."""
    token_level_rewards = torch.tensor([[1.0], [1.00001], [2.0], [2.00001]], dtype=torch.float32)
    response_mask = torch.ones_like(token_level_rewards)
    index = np.array(["prompt-a", "prompt-a", "prompt-b", "prompt-b"], dtype=object)
    expected = _loop_reference(token_level_rewards, response_mask, index, "grpo").float()
    # By hand: float32(1.00001) - 1 = float32(2.00001) - 2 = d = 84 * 2**-23; a = +-(d/2) / (d/sqrt(2) + 1e-6).
    d = 84 * 2.0**-23
    assert expected[0, 0].item() == pytest.approx(-(d / 2) / (d / math.sqrt(2) + 1e-6), rel=1e-6)

    for name in ("grpo", "grpo_vectorized"):
        adv, ret = _ours(name, token_level_rewards, response_mask, index)
        torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ret, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch_size,seq_len,num_groups,seed", CASES)
def test_grpo_and_vectorized_equivalence(batch_size, seq_len, num_groups, seed):
    rewards, mask, index = _random_case(batch_size, seq_len, num_groups, seed)
    expected = _loop_reference(rewards, mask, index, "grpo").float()
    for name in ("grpo", "grpo_vectorized"):
        adv, ret = _ours(name, rewards, mask, index)
        assert adv.shape == ret.shape == (batch_size, seq_len)
        torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ret, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- KL estimators, straight-through spellings
def _reward_kl(log_probs, ref_log_probs, kl_type):
    """The per-token KL the in-reward penalty subtracts (beta 1, scores 0)."""
    rewards, _ = apply_kl_in_reward(
        token_level_scores=torch.zeros_like(log_probs),
        old_log_probs=log_probs,
        ref_log_probs=ref_log_probs,
        response_mask=torch.ones_like(log_probs),
        controller=KLController(value=1.0),
        kl_type=kl_type,
    )
    return -rewards


def _schulman(x: np.ndarray, base: str) -> np.ndarray:
    """x = log p - log p_ref; the estimators of Schulman's "Approximating KL divergence"."""
    if base in ("k1", "kl"):
        return x
    if base == "abs":
        return np.abs(x)
    r = np.clip(-x, -20.0, 20.0)  # k3 = low_var_kl, with verl's documented clamps (the second binds here)
    return np.clip(np.exp(r) - r - 1.0, -10.0, 10.0)


@pytest.mark.parametrize(
    "name,base", [("k1+", "k1"), ("kl+", "kl"), ("abs+", "abs"), ("k3+", "k3"), ("low_var_kl+", "low_var_kl")]
)
def test_kl_penalty_straight_through_value_matches_base(name, base):
    """The ``+`` suffix changes only a gradient, so its value is the base estimator's."""
    gen = torch.Generator().manual_seed(0)
    logprob = torch.randn(4, 8, generator=gen)
    ref_logprob = torch.randn(4, 8, generator=gen)

    plus_value = _reward_kl(logprob, ref_logprob, name)
    base_value = _reward_kl(logprob, ref_logprob, base)

    assert torch.allclose(plus_value, base_value)
    x = (logprob - ref_logprob).double().numpy()
    np.testing.assert_allclose(base_value.double().numpy(), _schulman(x, base), rtol=1e-5, atol=1e-6)


def test_straight_through_kl_loss_is_refused_naming_the_valid_types():
    """Not an upstream case: the straight-through actor KL loss is a feature we lack, refused, not ignored."""
    with pytest.raises(KLEstimatorError, match="k3\\+.*valid"):
        PolicyLossConfig(use_kl_loss=True, kl_loss_type="k3+")
