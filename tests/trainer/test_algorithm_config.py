"""verl's algorithm keys in main_grpo (no Ray): every estimator selectable, its inputs supplied by the
driver's advantage step, errors naming the key for what the trainer cannot run."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config
from verl_balance.algorithms import ADV_ESTIMATOR_REGISTRY, AdvantageInputs, compute_advantage
from verl_balance.batch_keys import LOSS_MASK_KEY, PROMPT_INDEX_KEY, VALUES_KEY
from verl_balance.protocol import Batch
from verl_balance.trainer.advantage_step import compute_step_advantages, prompt_baselines
from verl_balance.trainer.algorithm_config import AlgorithmSection, supported_estimators
from verl_balance.trainer.config import ConfigError
from verl_balance.trainer.grpo_config import register_grpo_schema, validate_grpo

register_grpo_schema()
UNSUPPORTED = {"optimal_token_baseline", "tir_optimal_token_baseline"}


def test_every_verl_estimator_but_the_optimal_token_baselines_is_selectable_in_main_grpo():
    assert set(ADV_ESTIMATOR_REGISTRY) - set(supported_estimators()) == UNSUPPORTED
    for name in supported_estimators():
        config = validate_grpo(compose_config("grpo", [f"algorithm.adv_estimator={name}"]))
        assert config.algorithm.adv_estimator == name
        assert config.use_critic == (name == "gae")


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_an_estimator_whose_input_is_not_derived_fails_naming_the_key_and_the_input(name):
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator.*sum_pi_squared.*calculate_sum_pi_squared"):
        validate_grpo(compose_config("grpo", [f"algorithm.adv_estimator={name}"]))


@pytest.mark.parametrize(
    "override,key",
    [
        ("algorithm.adv_estimator=grpo_typo", "algorithm.adv_estimator"),
        ("algorithm.use_kl_in_reward=true", "algorithm.use_kl_in_reward"),
        ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.enable"),
        ("algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is"),
        ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type"),
        ("algorithm.gdpo_reward_weights=[1.0]", "algorithm.gdpo_reward_weights"),
        ("algorithm.kl_ctrl.kl_coef=0.01", None),  # negative control: verl's key, accepted
        ("algorithm.kl_penalty=low_var_kl", None),
        ("actor_rollout_ref.actor.loss_agg_mode=token-sum", None),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "actor_rollout_ref.actor.policy_loss.loss_mode"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=dro", "actor_rollout_ref.actor.policy_loss.dro_beta"),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", None),
    ],
)
def test_algorithm_key_errors_name_the_full_key(override, key):
    cfg = compose_config("grpo", [override])
    if key is None:
        validate_grpo(cfg)
        return
    with pytest.raises(ConfigError, match=re.escape(key) + r"\b"):
        validate_grpo(cfg)


def test_estimators_without_groups_accept_one_response_per_prompt():
    for name, ok in (("reinforce_plus_plus", True), ("remax", True), ("rloo", False)):
        cfg = compose_config("grpo", [f"algorithm.adv_estimator={name}", "actor_rollout_ref.rollout.n=1"])
        if ok:
            validate_grpo(cfg)
        else:
            with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.n"):
                validate_grpo(cfg)


def _batch(rows: int = 8, width: int = 10, seed: int = 0) -> tuple[Batch, np.ndarray, dict]:
    """Rows of 2-4 prompt tokens and 1-6 response tokens, two prompts of four responses each."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, width)
    for i in range(rows):
        start = int(torch.randint(2, 4, (1,), generator=gen))
        length = int(torch.randint(1, 7, (1,), generator=gen))
        mask[i, start : start + length] = 1
    batch = Batch.from_dict(
        tensors={LOSS_MASK_KEY: mask, VALUES_KEY: torch.randn(rows, width, generator=gen) * mask},
        non_tensors={PROMPT_INDEX_KEY: np.repeat(np.arange(rows // 4), 4)},
    )
    scores = torch.randint(0, 3, (rows,), generator=gen).double().numpy()
    extras = {"acc": (scores > 0).astype(float), "format": torch.rand(rows, generator=gen).double().numpy()}
    return batch, scores, extras


def _reference_inputs(batch, scores, **extra) -> AdvantageInputs:
    """Hand-built verl inputs: the score on the last response token of each row."""
    mask = batch[LOSS_MASK_KEY]
    rewards = torch.zeros_like(mask)
    for i in range(len(mask)):
        rewards[i, int(mask[i].nonzero().max())] = float(scores[i])
    return AdvantageInputs(
        token_level_rewards=rewards, response_mask=mask, index=np.asarray(batch[PROMPT_INDEX_KEY]), **extra
    )


@pytest.mark.parametrize("name", sorted(set(ADV_ESTIMATOR_REGISTRY) - UNSUPPORTED))
def test_driver_advantages_equal_the_estimator_on_hand_built_verl_inputs(name):
    batch, scores, extras = _batch()
    overrides = {"gdpo_reward_keys": ["acc", "format"], "gdpo_reward_weights": [1.0, 0.5]} if name == "gdpo" else {}
    algorithm = AlgorithmSection(adv_estimator=name, gamma=0.9, lam=0.8, **overrides)
    baselines = torch.tensor([1.0, 0.0]).double()[batch[PROMPT_INDEX_KEY]] if name == "remax" else None
    got = compute_step_advantages(batch, scores=scores, extras=extras, algorithm=algorithm, reward_baselines=baselines)
    extra = {"values": batch[VALUES_KEY], "reward_baselines": baselines}
    if name == "gdpo":
        extra["reward_components"] = {k: torch.as_tensor(extras[k]) for k in ("acc", "format")}
    want = compute_advantage(
        adv_estimator=name, inputs=_reference_inputs(batch, scores, **extra), params=algorithm.advantage_params()
    )
    torch.testing.assert_close(got.advantages, want.advantages, rtol=1e-6, atol=1e-7)
    assert got.advantages.abs().sum() > 0  # the batch exercises the estimator
    assert (got.advantages[batch[LOSS_MASK_KEY] == 0] == 0).all()
    # negative control: other scores (gdpo: other components) give other advantages
    flipped = {k: v[::-1].copy() for k, v in extras.items()}
    other = compute_step_advantages(
        batch,
        scores=scores[::-1].copy(),
        extras=flipped if name == "gdpo" else extras,
        algorithm=algorithm,
        reward_baselines=baselines,
    )
    assert not torch.allclose(other.advantages, got.advantages)


def test_gdpo_reward_keys_missing_from_the_reward_fail_naming_the_key():
    batch, scores, extras = _batch()
    algorithm = AlgorithmSection(adv_estimator="gdpo", gdpo_reward_keys=["acc", "style"])
    with pytest.raises(ValueError, match=r"algorithm\.gdpo_reward_keys.*'style'"):
        compute_step_advantages(batch, scores=scores, extras=extras, algorithm=algorithm)


def test_remax_baselines_map_each_row_to_its_prompts_greedy_score():
    got = prompt_baselines(
        baseline_prompt_index=np.array([1, 0]), baseline_scores=np.array([5.0, 2.0]), row_prompt_index=[0, 0, 1, 1]
    )
    assert got.tolist() == [2.0, 2.0, 5.0, 5.0]
    with pytest.raises(ValueError, match="no greedy baseline for prompts \\[2\\]"):
        prompt_baselines(baseline_prompt_index=[0, 1], baseline_scores=[0.0, 1.0], row_prompt_index=[2])


@pytest.mark.parametrize(
    "mode,agg", [("sapo", "seq-mean-token-mean"), ("geo_mean", "seq-mean-token-mean"), ("gpg", "token-sum")]
)
def test_sapo_and_geo_mean_force_verls_aggregation_and_other_modes_keep_loss_agg_mode(mode, agg):
    config = validate_grpo(
        compose_config(
            "grpo",
            [
                f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
                "actor_rollout_ref.actor.loss_agg_mode=token-sum",
            ],
        )
    )
    assert config.engine_config(total_steps=1).loss_agg_mode == agg
    assert config.actor_rollout_ref.actor.loss_mode_config().loss_mode == mode
