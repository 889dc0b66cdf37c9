"""algorithm.use_kl_in_reward against verl 0.9.1's own ``apply_kl_penalty`` and KL controllers, on random
inputs (rewards, metrics and the controller's coefficient over several steps), and a hand-worked example."""

from __future__ import annotations

import math

import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.algorithms.kl_in_reward import (
    REWARD_KL_COEF_METRIC,
    REWARD_KL_METRIC,
    KLController,
    apply_kl_in_reward,
    build_kl_controller,
    in_reward_kl_type,
)

KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k3+", "kl+")
CTRL = {"kl_coef": 0.05, "target_kl": 0.02, "horizon": 40}


def make_step(seed: int, rows: int = 6, width: int = 9):
    """Scores on each row's last response token, old/ref log-probs, a response mask with an empty row."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[-1] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    scores = torch.zeros(rows, width)
    rows_with = lengths > 0
    scores[rows_with, lengths[rows_with] - 1] = torch.randint(0, 2, (int(rows_with.sum()),), generator=gen).float()
    old = -torch.rand(rows, width, generator=gen) * 3
    ref = old + 0.4 * torch.randn(rows, width, generator=gen)
    return scores, old, ref, mask


def test_in_reward_kl_equals_verls_apply_kl_penalty_over_steps_for_every_estimator_and_controller():
    ray_trainer = pytest.importorskip("verl.trainer.ppo.ray_trainer", reason=VERL_SKIP_REASON)
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo import core_algos

    for kl_type in KL_TYPES:
        for ctrl_type in ("fixed", "adaptive"):
            theirs = core_algos.get_kl_controller(OmegaConf.create({"type": ctrl_type, **CTRL}))
            ours = build_kl_controller(type=ctrl_type, **CTRL)
            for step in range(3):
                scores, old, ref, mask = make_step(step)
                data = DataProto.from_dict(
                    tensors={
                        "response_mask": mask,
                        "token_level_scores": scores,
                        "old_log_probs": old,
                        "ref_log_prob": ref,
                    }
                )
                data, want = ray_trainer.apply_kl_penalty(data, kl_ctrl=theirs, kl_penalty=kl_type)
                got, metrics = apply_kl_in_reward(
                    token_level_scores=scores,
                    old_log_probs=old,
                    ref_log_probs=ref,
                    response_mask=mask,
                    controller=ours,
                    kl_type=kl_type,
                )
                where = (kl_type, ctrl_type, step)
                torch.testing.assert_close(got, data.batch["token_level_rewards"], rtol=1e-6, atol=1e-7, msg=str(where))
                assert metrics == pytest.approx(want, rel=1e-6), where
                assert ours.value == pytest.approx(theirs.value, rel=1e-6), where


def test_hand_worked_k1_penalty_and_adaptive_update():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -9.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ctrl = KLController(value=0.1, target_kl=0.1, horizon=10)
    rewards, metrics = apply_kl_in_reward(
        token_level_scores=scores,
        old_log_probs=old,
        ref_log_probs=ref,
        response_mask=mask,
        controller=ctrl,
        kl_type="kl",
    )
    # k1 = old - ref per token: row 0 [0.5, -1, 0], row 1 [1, 0, (masked)]
    expected = torch.tensor([[-0.05, 0.1, 1.0], [-0.1, 2.0, 0.0]])
    torch.testing.assert_close(rewards, expected)
    current = ((0.5 - 1.0 + 0.0) / 3 + (1.0 + 0.0) / 2) / 2  # mean of row means = 1/6
    assert metrics == {REWARD_KL_METRIC: pytest.approx(current), REWARD_KL_COEF_METRIC: 0.1}
    # adaptive: error = clip(current / 0.1 - 1, -0.2, 0.2) = 0.2; beta *= 1 + 0.2 * 2 rows / 10
    assert ctrl.value == pytest.approx(0.1 * 1.04)


def test_fixed_controller_keeps_its_coefficient_and_adaptive_moves_toward_the_target():
    fixed, adaptive = build_kl_controller(type="fixed", **CTRL), build_kl_controller(type="adaptive", **CTRL)
    for controller in (fixed, adaptive):
        controller.update(current_kl=1.0, n_steps=8)  # far above target_kl: adaptive grows
    assert fixed.value == CTRL["kl_coef"]
    assert adaptive.value == pytest.approx(CTRL["kl_coef"] * (1 + 0.2 * 8 / 40))
    adaptive.update(current_kl=0.0, n_steps=8)  # below target: shrinks
    assert adaptive.value < CTRL["kl_coef"] * (1 + 0.2 * 8 / 40)


def test_the_penalty_uses_the_coefficient_before_this_steps_update():
    """verl subtracts beta * kl with beta read before kl_ctrl.update (negative control: the updated one differs)."""
    scores, old, ref, mask = make_step(0)
    ctrl = build_kl_controller(type="adaptive", **CTRL)
    rewards, metrics = apply_kl_in_reward(
        token_level_scores=scores,
        old_log_probs=old,
        ref_log_probs=ref,
        response_mask=mask,
        controller=ctrl,
        kl_type="kl",
    )
    assert metrics[REWARD_KL_COEF_METRIC] == CTRL["kl_coef"] != ctrl.value
    assert not torch.equal(rewards, scores)


@pytest.mark.parametrize("bad", ["full", "k4", "+"])
def test_an_unknown_kl_penalty_is_refused_naming_the_key(bad):
    with pytest.raises(ValueError, match=r"kl_penalty=.*valid"):
        in_reward_kl_type(bad)


def test_adaptive_controller_needs_a_positive_horizon_and_target():
    for bad in ({"horizon": 0}, {"target_kl": 0.0}):
        with pytest.raises(ValueError, match="algorithm.kl_ctrl.type=adaptive"):
            build_kl_controller(type="adaptive", **{**CTRL, **bad})
    assert math.isclose(build_kl_controller(type="fixed", **{**CTRL, "horizon": 0}).value, CTRL["kl_coef"])
