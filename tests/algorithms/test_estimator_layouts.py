"""Every ``algorithm.adv_estimator``'s advantages through TrainEngine on dp=2 and on sp=2, token-capped
(dynamic) balanced micro-batches == the single-process PPO reference of test_ppo_loss_layouts.py (loss,
metrics, gradient norm, parameters after one AdamW step).

An estimator runs on the driver before dispatch, on whole rows; what a layout can get wrong is the
wire: a per-token advantage (gae, reinforce_plus_plus, the optimal-token baselines vary along the
response) must reach its own token on whichever DP rank and SP slice holds it. Negative controls: the
rows are distinct (each estimator's reference differs from grpo's, so a row that dropped its own
advantages for another's would fail), and for the token-varying estimators a one-token shift of the
advantages changes the reference beyond the comparison's tolerance. The engine-level controls (sums
left local on an SP slice) are test_ppo_loss_layouts.py's.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from tests.algorithms.test_ppo_loss_layouts import LOSS_CONFIG, _assert_matches, _ppo_batch, _references, _run_case
from verl_balance.algorithms import PPOLoss
from verl_balance.algorithms.advantages import last_token_rewards
from verl_balance.algorithms.estimator_inputs import AdvantageInputs, AdvantageParams
from verl_balance.algorithms.estimators import ADV_ESTIMATOR_REGISTRY, compute_advantage
from verl_balance.distributed.launcher import run_on_ranks

ESTIMATORS = sorted(ADV_ESTIMATOR_REGISTRY)
PARAMS = AdvantageParams(gamma=0.9, lam=0.8)
"""gamma, lam < 1: the discounted estimators vary along the response, so misplaced tokens would show."""
TOKEN_VARYING = ("gae", "reinforce_plus_plus", "optimal_token_baseline", "tir_optimal_token_baseline")
GROUP_SIZE = 4


def _estimator_batches() -> dict[str, dict[str, torch.Tensor]]:
    """The parity batch once per estimator, its ``advantages`` column that estimator's output."""
    batch = _with_tool_tokens(_ppo_batch())
    gen = torch.Generator().manual_seed(13)
    mask = batch["loss_mask"].float()
    rows = len(mask)
    scores = torch.randint(0, 3, (rows,), generator=gen).float()
    inputs = AdvantageInputs(
        token_level_rewards=last_token_rewards(scores=scores, response_mask=mask),
        response_mask=mask,
        index=np.arange(rows) // GROUP_SIZE,
        values=torch.randn(mask.shape, generator=gen) * mask,
        old_log_probs=batch["old_log_probs"],
        sum_pi_squared=(0.2 + 0.6 * torch.rand(mask.shape, generator=gen)) * mask,
        reward_baselines=torch.rand(rows, generator=gen),
    )
    out = {}
    for name in ESTIMATORS:
        advantages = compute_advantage(adv_estimator=name, inputs=inputs, params=PARAMS).advantages
        assert torch.isfinite(advantages).all() and (advantages * (1 - mask)).abs().max() == 0, name
        out[name] = {**batch, "advantages": advantages}
    return out


def _with_tool_tokens(batch):
    """The batch with one untrained token inside each response of 4 or more tokens, as a tool's output
    inside a multi-turn response is (it is what tir_optimal_token_baseline treats apart)."""
    mask = batch["loss_mask"].float().clone()
    for row in mask:
        trained = row.nonzero().flatten()
        if len(trained) >= 4:
            row[trained[len(trained) // 2]] = 0
    return {**batch, "loss_mask": mask}


def _worker(rank, *, dp, sp, batches):
    from verl_balance.distributed import ParallelLayout
    from verl_balance.engine import TrainEngine

    layout = ParallelLayout(dp=dp, sp=sp, device_type="cpu")
    loss_fn = PPOLoss(LOSS_CONFIG)
    return {
        name: _run_case(TrainEngine, layout, b, "dynamic", True, "token-mean", loss_fn) for name, b in batches.items()
    }


@pytest.fixture(scope="module")
def batches():
    return _estimator_batches()


@pytest.fixture(scope="module")
def references(batches):
    return {name: _references(b, [("token-mean", LOSS_CONFIG, None)])[0] for name, b in batches.items()}


@pytest.mark.slow
@pytest.mark.parametrize("dp,sp", [(2, 1), (1, 2)])
def test_every_estimator_is_layout_invariant_with_token_capped_micro_batches(batches, references, dp, sp):
    results = run_on_ranks(functools.partial(_worker, dp=dp, sp=sp, batches=batches), world=dp * sp)[0]
    assert sorted(results) == ESTIMATORS
    for name in ESTIMATORS:
        _assert_matches(results[name], references[name], where=f"dp={dp} sp={sp} adv_estimator={name}")


def test_every_estimator_row_is_its_own(references):
    """Negative control: no two rows share a reference (grpo and grpo_vectorized, rloo and
    rloo_vectorized are the same function under two names, as in verl)."""
    twins = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}
    base = references["grpo"]["loss"]
    for name in ESTIMATORS:
        if name in ("grpo", *twins):
            continue
        assert abs(references[name]["loss"] - base) > 1e-4 * abs(base), name
    for twin, original in twins.items():
        assert references[twin]["loss"] == pytest.approx(references[original]["loss"], rel=1e-6)


@pytest.mark.parametrize("name", TOKEN_VARYING)
def test_a_one_token_shift_of_a_token_varying_advantage_is_detected(batches, references, name):
    """Negative control: advantages one token off (what a misaligned SP slice would feed the loss) give a
    reference the layout comparison tells apart."""
    batch = batches[name]
    assert batch["advantages"][batch["loss_mask"].bool()].unique().numel() > len(batch["loss_mask"]), name
    shifted = {**batch, "advantages": torch.roll(batch["advantages"], 1, dims=1) * batch["loss_mask"]}
    wrong = _references(shifted, [("token-mean", LOSS_CONFIG, None)])[0]
    right = references[name]
    # 100x the comparison's relative tolerance (1e-5)
    assert abs(wrong["loss"] - right["loss"]) > 1e-3 * abs(right["loss"]), name
    assert abs(wrong["grad_norm"] - right["grad_norm"]) > 1e-3 * right["grad_norm"], name
