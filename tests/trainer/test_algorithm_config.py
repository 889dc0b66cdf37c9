"""verl's algorithm keys in main_grpo (no Ray): every estimator selectable, its inputs supplied by the
driver's advantage step, errors naming the key for what the trainer cannot run."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config
from verl_balance.algorithms import ADV_ESTIMATOR_REGISTRY, AdvantageInputs, compute_advantage
from verl_balance.algorithms.rollout_correction import RolloutCorrectionConfig
from verl_balance.batch_keys import (
    LOSS_MASK_KEY,
    OLD_LOG_PROBS_KEY,
    PROMPT_INDEX_KEY,
    REF_LOG_PROB_KEY,
    ROLLOUT_IS_WEIGHTS_KEY,
    ROLLOUT_LOG_PROBS_KEY,
    SUM_PI_SQUARED_KEY,
    VALUES_KEY,
)
from verl_balance.protocol import Batch
from verl_balance.trainer.config import ConfigError
from verl_balance.trainer.config.algorithm import AlgorithmSection, supported_estimators
from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo
from verl_balance.trainer.grpo.advantage_step import (
    compute_step_advantages,
    correct_rollout,
    prompt_baselines,
    token_level_rewards,
)

register_grpo_schema()
OTB = ("optimal_token_baseline", "tir_optimal_token_baseline")


def test_every_verl_estimator_is_selectable_in_main_grpo():
    assert set(supported_estimators()) == set(ADV_ESTIMATOR_REGISTRY)
    for name in supported_estimators():
        config = validate_grpo(compose_config("grpo", [f"algorithm.adv_estimator={name}"]))
        assert config.algorithm.adv_estimator == name
        assert config.use_critic == (name == "gae")
        assert config.algorithm.needs_sum_pi_squared == (name in OTB)


@pytest.mark.parametrize("name", OTB)
def test_optimal_token_baselines_run_the_old_log_prob_pass_before_the_advantages(name):
    on_policy = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    config = validate_grpo(compose_config("grpo", [*on_policy, f"algorithm.adv_estimator={name}"]))
    assert config.algorithm.needs_old_log_probs_before_advantages
    assert not config.old_log_prob_from_update  # the pass that computes sum_pi_squared runs
    grpo = validate_grpo(compose_config("grpo", [*on_policy, "algorithm.adv_estimator=grpo"]))
    assert grpo.old_log_prob_from_update  # negative control: grpo takes them from the update


@pytest.mark.parametrize(
    "override,key",
    [
        ("algorithm.adv_estimator=grpo_typo", "algorithm.adv_estimator"),
        ("algorithm.use_kl_in_reward=true", None),  # built (issue 30 item 2): accepted
        ("algorithm.filter_groups.enable=true", None),
        ("algorithm.rollout_correction.rollout_is=token", None),
        ("algorithm.rollout_correction.bypass_mode=true", None),
        ("algorithm.kl_penalty=full", "algorithm.kl_penalty"),
        ("algorithm.rollout_correction.rollout_is=tokens", "algorithm.rollout_correction.rollout_is"),
        ("algorithm.use_pf_ppo=true", "algorithm.use_pf_ppo"),
        ("custom_reward_function.reward_manager=prime", "custom_reward_function.reward_manager"),
        ("custom_reward_function.overlong_buffer.enable=true", "custom_reward_function.overlong_buffer.enable"),
        ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type"),
        ("algorithm.gdpo_reward_weights=[1.0]", "algorithm.gdpo_reward_weights"),
        ("algorithm.kl_ctrl.kl_coef=0.01", None),  # negative control: verl's key, accepted
        ("algorithm.kl_penalty=low_var_kl", None),
        ("actor_rollout_ref.actor.loss_agg_mode=token-sum", None),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", None),  # mini-batch-wide selection: accepted
        ("actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov", None),
        ("actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode", None),  # built (issue 30 item 2): accepted
        ("actor_rollout_ref.actor.policy_loss.loss_mode=vanila", "actor_rollout_ref.actor.policy_loss.loss_mode"),
        ("algorithm.rollout_correction.loss_type=ppo", "algorithm.rollout_correction.loss_type"),
        (
            "actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type=reinforced",
            "actor_rollout_ref.actor.policy_loss.rollout_correction.loss_type",
        ),
        (
            "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs=seq_max_k1",
            "actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_rs",
        ),
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
    old_log_probs = -torch.rand(rows, width, generator=gen) * 3 * mask
    sum_pi_squared = (old_log_probs.exp().square() + 0.2 * torch.rand(rows, width, generator=gen)).clamp(max=1) * mask
    tensors = {LOSS_MASK_KEY: mask, VALUES_KEY: torch.randn(rows, width, generator=gen) * mask}
    tensors.update({OLD_LOG_PROBS_KEY: old_log_probs, SUM_PI_SQUARED_KEY: sum_pi_squared})
    batch = Batch.from_dict(
        tensors=tensors,
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


@pytest.mark.parametrize("name", sorted(ADV_ESTIMATOR_REGISTRY))
def test_driver_advantages_equal_the_estimator_on_hand_built_verl_inputs(name):
    batch, scores, extras = _batch()
    overrides = {"gdpo_reward_keys": ["acc", "format"], "gdpo_reward_weights": [1.0, 0.5]} if name == "gdpo" else {}
    algorithm = AlgorithmSection(adv_estimator=name, gamma=0.9, lam=0.8, **overrides)
    baselines = torch.tensor([1.0, 0.0]).double()[batch[PROMPT_INDEX_KEY]] if name == "remax" else None
    got = compute_step_advantages(batch, scores=scores, extras=extras, algorithm=algorithm, reward_baselines=baselines)
    extra = {"values": batch[VALUES_KEY], "reward_baselines": baselines}
    if name in OTB:
        extra.update(old_log_probs=batch[OLD_LOG_PROBS_KEY], sum_pi_squared=batch[SUM_PI_SQUARED_KEY])
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


KL_IN_REWARD = "algorithm.use_kl_in_reward=true"
ASYNC = "trainer.v1.trainer_mode=separate_async"
OVERLONG = ["custom_reward_function.overlong_buffer.enable=true", "custom_reward_function.overlong_buffer.len=2"]


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=0"], "algorithm.kl_ctrl.horizon"),
        (["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=remax"], "algorithm.filter_groups.enable"),
        (["algorithm.filter_groups.enable=true", ASYNC], "algorithm.filter_groups.enable"),
        (["algorithm.rollout_correction.rollout_is=token", ASYNC], "actor_rollout_ref.actor.recompute_old_log_prob"),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k2",
                "algorithm.rollout_correction.rollout_rs_threshold=0.1",
                ASYNC,
            ],
            "algorithm.rollout_correction.rollout_is/rollout_rs",
        ),
        (
            ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward", KL_IN_REWARD],
            "algorithm.filter_groups.metric",
        ),
        (
            ["algorithm.rollout_correction.bypass_mode=true", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
            "but loss_mode='gspo' is set",
        ),
        (
            ["algorithm.adv_estimator=optimal_token_baseline", "algorithm.rollout_correction.bypass_mode=true"],
            "algorithm.adv_estimator='optimal_token_baseline' with algorithm.rollout_correction.bypass_mode",
        ),
        (
            ["algorithm.adv_estimator=tir_optimal_token_baseline", ASYNC],
            "actor_rollout_ref.actor.recompute_old_log_prob='auto' skips",
        ),
        (
            ["custom_reward_function.reward_manager=dapo", OVERLONG[0], "custom_reward_function.overlong_buffer.len=9"],
            "custom_reward_function.overlong_buffer.len",
        ),
    ],
)
def test_combinations_main_grpo_cannot_run_fail_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        validate_grpo(compose_config("grpo", ["actor_rollout_ref.rollout.response_length=8", *overrides]))


BYPASS = [
    "algorithm.rollout_correction.bypass_mode=true",
    "algorithm.rollout_correction.loss_type=reinforce",
    "algorithm.rollout_correction.rollout_is=sequence",
    "algorithm.rollout_correction.rollout_is_batch_normalize=true",
    "algorithm.rollout_correction.rollout_rs='token_k2,seq_max_k3'",
    "algorithm.rollout_correction.rollout_rs_threshold=0.1",
]


def test_bypass_mode_with_reinforce_is_weights_and_rejection_runs_as_the_bypass_loss_mode():
    """algorithm.rollout_correction.bypass_mode=true with IS weights and rejection (refused before issue 30
    item 2): the actor's loss mode is bypass_mode with the algorithm's keys (verl's apply_bypass_mode), the
    old log-prob pass is skipped, and the decoupled correction does not also run on the driver."""
    config = validate_grpo(compose_config("grpo", BYPASS))
    mode = config.loss_mode_config()
    assert mode.loss_mode == "bypass_mode" and mode.rollout_correction == config.algorithm.rollout_correction
    assert mode.rollout_correction.loss_type == "reinforce" and mode.rollout_correction.rollout_is == "sequence"
    assert not config.old_log_prob_from_update and not config.algorithm.corrects_rollout
    plain = validate_grpo(compose_config("grpo", BYPASS[1:]))  # negative control: no bypass, decoupled mode
    assert plain.loss_mode_config().loss_mode == "vanilla" and plain.algorithm.corrects_rollout


def test_the_actor_workers_get_the_bypass_loss_mode_of_the_algorithm_keys():
    """GRPOTrainer._worker_config hands the workers GRPOConfig.loss_mode_config (not the actor section's own)."""
    from types import SimpleNamespace

    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)
    # negative control: without bypass_mode the workers run vanilla and the actor's own (default) keys
    for overrides, want in ((BYPASS, ("bypass_mode", "sequence")), (BYPASS[1:], ("vanilla", None))):
        config = validate_grpo(compose_config("grpo", overrides))
        arr = config.actor_rollout_ref
        trainer.config, trainer.total_steps, trainer.sp = config, 1, 1
        trainer.model_config = arr.model.model_config(vocab_size=300)
        trainer.actor_cfg, trainer.rollout_cfg, trainer.policy_loss = (
            arr.actor,
            arr.rollout,
            arr.actor.policy_loss_config(),
        )
        trainer.tokenizer = SimpleNamespace(vocab_size=300, pad_token_id=0, eos_token_id=1)
        trainer.trainer_config, trainer.model_section = config.trainer, arr.model
        mode = trainer._worker_config().loss_mode
        assert (mode.loss_mode, mode.rollout_correction.rollout_is) == want


def test_policy_loss_bypass_mode_reads_the_actors_rollout_correction_keys():
    """actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode takes policy_loss.rollout_correction.*, where
    verl's bypass loss reads them."""
    keys = ["loss_mode=bypass_mode", "rollout_correction.loss_type=reinforce", "rollout_correction.rollout_is=token"]
    config = validate_grpo(compose_config("grpo", [f"actor_rollout_ref.actor.policy_loss.{k}" for k in keys]))
    mode = config.loss_mode_config()
    assert (mode.loss_mode, mode.rollout_correction.loss_type, mode.rollout_correction.rollout_is) == (
        "bypass_mode",
        "reinforce",
        "token",
    )
    assert config.algorithm.rollout_correction.rollout_is is None  # the algorithm's keys stay verl's defaults


@pytest.mark.parametrize("mode", ["separate_async", "colocate_async"])
def test_async_modes_take_the_decoupled_rollout_correction_when_the_old_log_probs_are_recomputed(mode):
    overrides = [
        "actor_rollout_ref.rollout.response_length=8",
        f"trainer.v1.trainer_mode={mode}",
        "actor_rollout_ref.rollout.nnodes=1",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=token_k2",
        "algorithm.rollout_correction.rollout_rs_threshold=0.02",
    ]
    with pytest.raises(ConfigError, match=re.escape("recompute_old_log_prob='auto'")):  # negative control
        validate_grpo(compose_config("grpo", overrides))
    recomputed = [*overrides, "actor_rollout_ref.actor.recompute_old_log_prob=always"]
    config = validate_grpo(compose_config("grpo", recomputed))
    assert config.algorithm.corrects_rollout and config.trainer.v1.trainer_mode == mode


@pytest.mark.parametrize(
    "override,reference,old_pass",
    [
        (KL_IN_REWARD, True, True),
        ("actor_rollout_ref.actor.use_kl_loss=true", True, False),
        ("algorithm.rollout_correction.rollout_rs=token_k2", False, True),
        ("algorithm.rollout_correction.bypass_mode=true", False, True),
        ("algorithm.adv_estimator=grpo", False, False),  # negative control: on-policy, no reference
    ],
)
def test_kl_in_reward_runs_the_reference_and_the_old_log_prob_pass_and_correction_the_old_pass(
    override, reference, old_pass
):
    extra = ["algorithm.rollout_correction.rollout_rs_threshold=0.1"] if "rollout_rs=" in override else []
    on_policy = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    config = validate_grpo(compose_config("grpo", [*on_policy, override, *extra]))
    assert config.use_reference_policy == reference
    # the on-policy shortcut takes the old log-probs from the update: never when the driver reads them first
    assert config.old_log_prob_from_update == (not old_pass)


def test_verls_dapo_reward_manager_keys_reach_the_reward_section():
    from verl_balance.trainer.config.grpo import GRPOConfig

    for prefix in ("reward.reward_kwargs", "+reward_model.reward_kwargs"):
        manager = "reward.reward_manager.name" if prefix.startswith("reward.") else "reward_model.reward_manager"
        args = [
            f"{manager}=dapo",
            f"{prefix}.overlong_buffer_cfg.enable=true",
            f"{prefix}.overlong_buffer_cfg.len=3",
            f"{prefix}.overlong_buffer_cfg.penalty_factor=0.5",
            f"{prefix}.overlong_buffer_cfg.log=true",
            f"{prefix}.max_resp_len=6",
        ]
        _, no_effect = GRPOConfig.translate(compose_config("grpo", args))
        assert not no_effect
        reward = validate_grpo(compose_config("grpo", args)).custom_reward_function
        assert reward.reward_manager == "dapo" and reward.max_resp_len == 6
        assert (reward.overlong_buffer.len, reward.overlong_buffer.penalty_factor) == (3, 0.5)
        assert reward.overlong_buffer.enable and reward.overlong_buffer.log


def _kl_batch():
    batch, scores, extras = _batch()
    gen = torch.Generator().manual_seed(3)
    mask = batch[LOSS_MASK_KEY]
    batch[OLD_LOG_PROBS_KEY] = -torch.rand(mask.shape, generator=gen) * mask
    batch[REF_LOG_PROB_KEY] = (batch[OLD_LOG_PROBS_KEY] + 0.3 * torch.randn(mask.shape, generator=gen)) * mask
    batch[ROLLOUT_LOG_PROBS_KEY] = (batch[OLD_LOG_PROBS_KEY] + 0.2 * torch.randn(mask.shape, generator=gen)) * mask
    return batch, scores, extras


def test_driver_rewards_with_kl_are_the_scores_minus_the_penalty_before_the_estimator():
    batch, scores, extras = _kl_batch()
    algorithm = AlgorithmSection(use_kl_in_reward=True, kl_penalty="k2")
    controller = algorithm.kl_ctrl.controller()
    rewards, metrics = token_level_rewards(batch, scores=scores, algorithm=algorithm, kl_controller=controller)
    mask = batch[LOSS_MASK_KEY]
    kl = 0.5 * (batch[OLD_LOG_PROBS_KEY] - batch[REF_LOG_PROB_KEY]).square() * mask
    want = _reference_inputs(batch, scores).token_level_rewards - 0.001 * kl
    torch.testing.assert_close(rewards, want, rtol=1e-6, atol=1e-7)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.001
    got = compute_step_advantages(batch, scores=scores, extras=extras, algorithm=algorithm, rewards=rewards)
    plain = compute_step_advantages(batch, scores=scores, extras=extras, algorithm=algorithm)
    assert not torch.allclose(got.advantages, plain.advantages)  # negative control: the penalty reaches them
    off, no_metrics = token_level_rewards(batch, scores=scores, algorithm=AlgorithmSection(), kl_controller=None)
    assert no_metrics == {} and torch.equal(off, _reference_inputs(batch, scores).token_level_rewards)


def test_rollout_rejection_leaves_the_rewards_where_they_were_and_the_estimator_sees_the_kept_mask():
    """verl: token_level_scores sit on the original last token; the advantages use the modified mask."""
    batch, scores, extras = _kl_batch()
    original = batch[LOSS_MASK_KEY].clone()
    corr = RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=1.1, rollout_rs="token_k1", rollout_rs_threshold="0.85_1.15"
    )
    algorithm = AlgorithmSection(rollout_correction=corr)
    rewards, _ = token_level_rewards(batch, scores=scores, algorithm=algorithm, kl_controller=None)
    metrics = correct_rollout(batch, algorithm=algorithm)
    kept = batch[LOSS_MASK_KEY]
    assert 0 < kept.sum() < original.sum() and "rollout_corr/rollout_rs_masked_fraction" in metrics
    assert ROLLOUT_IS_WEIGHTS_KEY in batch and (batch[ROLLOUT_IS_WEIGHTS_KEY] <= 1.1).all()
    got = compute_step_advantages(batch, scores=scores, extras=extras, algorithm=algorithm, rewards=rewards)
    inputs = _reference_inputs(
        Batch.from_dict(tensors={LOSS_MASK_KEY: original}, non_tensors={PROMPT_INDEX_KEY: batch[PROMPT_INDEX_KEY]}),
        scores,
    )
    want = compute_advantage(
        adv_estimator="grpo",
        inputs=dataclasses.replace(inputs, response_mask=kept),
        params=algorithm.advantage_params(),
    )
    torch.testing.assert_close(got.advantages, want.advantages, rtol=1e-6, atol=1e-7)
    assert (got.advantages[kept == 0] == 0).all()


def test_the_estimators_get_every_algorithm_key_they_read_from_one_declaration():
    from verl_balance.algorithms.estimator_inputs import AdvantageKeys, AdvantageParams

    # one declaration: the section and the estimators' params both extend AdvantageKeys
    assert issubclass(AlgorithmSection, AdvantageKeys) and issubclass(AdvantageParams, AdvantageKeys)
    overrides = {
        "gamma": 0.9,
        "lam": 0.8,
        "norm_adv_by_std_in_grpo": False,
        "gdpo_reward_keys": ["fmt", "acc"],
        "gdpo_reward_weights": [0.25, 0.75],
    }
    assert set(overrides) == {f.name for f in dataclasses.fields(AdvantageKeys)}
    args = [
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[fmt,acc]",
        "algorithm.gdpo_reward_weights=[0.25,0.75]",
    ]
    args += ["algorithm.gamma=0.9", "algorithm.lam=0.8", "algorithm.norm_adv_by_std_in_grpo=false"]
    params = validate_grpo(compose_config("grpo", args)).algorithm.advantage_params()
    # reference: the same params built by hand, the estimators' own constants at their defaults
    assert params == AdvantageParams(**overrides)
    assert (params.epsilon, params.otb_epsilon) == (1e-6, 1e-8)
    # negative control: the recipe's defaults give other params
    assert validate_grpo(compose_config("grpo", [])).algorithm.advantage_params() != params
