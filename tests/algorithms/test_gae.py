"""GAE (adv_estimator=gae) against verl's own ``compute_gae_advantage_return`` and a hand-worked example.

Our batches hold whole sequences (prompt + response + padding, the response marked by the loss
mask); verl's hold the response slice only, right-padded. The reference test builds both layouts
of the same responses and compares token by token on the response tokens.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.algorithms import AdvantageInputError, compute_advantages, compute_gae, last_token_rewards


def _full_and_response_layouts(*, seed: int, rows: int = 6, width: int = 12, max_response: int = 7):
    """Random prompts/responses in both layouts: ours (B, width) and verl's (B, max_response)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, width - max_response + 1, (rows,), generator=gen)
    response_len = torch.randint(1, max_response + 1, (rows,), generator=gen)
    full_mask = torch.zeros(rows, width)
    full_values = torch.randn(rows, width, generator=gen)  # garbage outside the response on purpose
    response_mask = torch.zeros(rows, max_response)
    response_values = torch.zeros(rows, max_response)
    for i in range(rows):
        p, r = int(prompt_len[i]), int(response_len[i])
        full_mask[i, p : p + r] = 1
        response_mask[i, :r] = 1
        response_values[i, :r] = full_values[i, p : p + r]
    scores = torch.randn(rows, generator=gen)
    return {
        "scores": scores,
        "full_mask": full_mask,
        "full_values": full_values,
        "response_mask": response_mask,
        "response_values": response_values,
        "prompt_len": prompt_len,
        "response_len": response_len,
    }


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_on_full_sequences_equals_verl_on_the_response_slice(seed, gamma, lam):
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason=VERL_SKIP_REASON)
    d = _full_and_response_layouts(seed=seed)
    # verl's reward manager puts the score on the last valid response token.
    verl_rewards = torch.zeros_like(d["response_mask"])
    verl_rewards[torch.arange(len(d["scores"])), d["response_len"] - 1] = d["scores"]
    ref_adv, ref_ret = core_algos.compute_gae_advantage_return(
        token_level_rewards=verl_rewards,
        values=d["response_values"],
        response_mask=d["response_mask"],
        gamma=gamma,
        lam=lam,
    )
    out = compute_advantages(
        adv_estimator="gae",
        scores=d["scores"],
        index=None,
        loss_mask=d["full_mask"],
        values=d["full_values"],
        gamma=gamma,
        lam=lam,
    )
    for i in range(len(d["scores"])):
        p, r = int(d["prompt_len"][i]), int(d["response_len"][i])
        torch.testing.assert_close(out.advantages[i, p : p + r], ref_adv[i, :r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.returns[i, p : p + r], ref_ret[i, :r], rtol=1e-5, atol=1e-6)
    outside = d["full_mask"] == 0
    assert (out.advantages[outside] == 0).all() and (out.returns[outside] == 0).all()


@pytest.mark.parametrize("seed", [3, 4])
def test_compute_gae_equals_verl_on_the_same_masked_tensors(seed):
    """Same inputs to both functions (random masks with holes anywhere): equal on the valid tokens."""
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason=VERL_SKIP_REASON)
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(5, 9, generator=gen) < 0.6).float()
    mask[0, :2] = 1  # at least two valid tokens
    rewards, values = torch.randn(5, 9, generator=gen), torch.randn(5, 9, generator=gen)
    ref_adv, ref_ret = core_algos.compute_gae_advantage_return(
        token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.97, lam=0.9
    )
    adv, ret = compute_gae(token_level_rewards=rewards, values=values, response_mask=mask, gamma=0.97, lam=0.9)
    valid = mask.bool()
    torch.testing.assert_close(adv[valid], ref_adv[valid], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ret[valid], ref_ret[valid], rtol=1e-5, atol=1e-6)


def test_three_token_example_worked_by_hand():
    """Prompt token, 3 response tokens with values 0.5, 0.2, 0.4, padding; score 1; gamma 0.9, lam 0.5.

    t=3: delta = 1 - 0.4 = 0.6                 A3 = 0.6
    t=2: delta = 0.9*0.4 - 0.2 = 0.16          A2 = 0.16 + 0.45*0.6 = 0.43
    t=1: delta = 0.9*0.2 - 0.5 = -0.32         A1 = -0.32 + 0.45*0.43 = -0.1265
    returns = A + V = 0.3735, 0.63, 1.0; advantages whitened with the unbiased variance.
    """
    mask = torch.tensor([[0.0, 1, 1, 1, 0]])
    values = torch.tensor([[9.0, 0.5, 0.2, 0.4, -9.0]])  # prompt and padding values must not matter
    out = compute_advantages(
        adv_estimator="gae", scores=[1.0], index=[0], loss_mask=mask, values=values, gamma=0.9, lam=0.5
    )
    raw = [-0.1265, 0.43, 0.6]
    mean, var = statistics.fmean(raw), statistics.variance(raw)
    whitened = [(a - mean) / math.sqrt(var + 1e-8) for a in raw]
    torch.testing.assert_close(out.advantages, torch.tensor([[0.0, *whitened, 0.0]]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.returns, torch.tensor([[0.0, 0.3735, 0.63, 1.0, 0.0]]), rtol=1e-5, atol=1e-6)


def test_score_lands_on_the_last_response_token():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    rewards = last_token_rewards(scores=[2.0, 3.0, 4.0, 5.0], response_mask=mask)
    expected = torch.tensor([[0, 0, 2.0, 0], [0, 0, 0, 3.0], [0, 0, 0, 4.0], [0, 0, 0, 0]])
    torch.testing.assert_close(rewards, expected)


def test_outcome_estimators_are_unchanged_and_give_no_returns():
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    out = compute_advantages(adv_estimator="grpo", scores=[1.0, 3.0], index=[0, 0], loss_mask=mask, epsilon=0.0)
    std = math.sqrt(2.0)  # unbiased std of [1, 3]
    torch.testing.assert_close(out.advantages, torch.tensor([[0, -1 / std, -1 / std], [0, 1 / std, 0]]))
    assert out.returns is None


def test_gae_input_errors_name_the_problem():
    mask = torch.tensor([[0.0, 1, 1]])
    with pytest.raises(AdvantageInputError, match="needs the critic's values"):
        compute_advantages(adv_estimator="gae", scores=[1.0], index=[0], loss_mask=mask)
    with pytest.raises(AdvantageInputError, match="not finite"):
        compute_advantages(
            adv_estimator="gae", scores=[1.0], index=[0], loss_mask=mask, values=torch.tensor([[0, float("nan"), 0]])
        )
    with pytest.raises(AdvantageInputError, match="at least 2"):
        one_token = torch.tensor([[0.0, 1, 0]])
        compute_advantages(adv_estimator="gae", scores=[1.0], index=[0], loss_mask=one_token, values=torch.zeros(1, 3))
    with pytest.raises(AdvantageInputError, match="same \\(B, L\\)"):
        compute_gae(token_level_rewards=torch.zeros(1, 3), values=torch.zeros(1, 2), response_mask=mask, gamma=1, lam=1)
