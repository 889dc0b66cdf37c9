"""main_grpo with verl's algorithm set on the synthetic task: ONE trainer (one worker group, the session
Ray cluster) whose steps run every estimator in turn, with a loss mode that needs the engine's
SP-reduced sequence sums (gspo). The estimator is driver-side state, so switching it between steps
runs each one through the trainer's real rollout, scoring, log-prob and update path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config
from verl_balance.algorithms import LossModeConfig, compute_advantage
from verl_balance.algorithms.rollout_correction import RolloutCorrectionConfig, decoupled_correction
from verl_balance.trainer.algorithm_config import AlgorithmSection, supported_estimators
from verl_balance.trainer.grpo_config import register_grpo_schema

register_grpo_schema()
COV_MODES = ("clip_cov", "kl_cov")


@pytest.fixture(scope="module")
def algorithm_steps(ray_cluster, tmp_path_factory):
    from verl_balance.trainer.grpo_trainer import GRPOTrainer

    root = tmp_path_factory.mktemp("grpo_algorithms")
    cfg = compose_config(
        "grpo",
        [
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=2",
            "trainer.logger=[jsonl]",
            "trainer.plot=false",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={root / 'run'}",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "data.synthetic.num_train=64",
            "data.synthetic.num_val=4",
            f"data.synthetic.out_dir={root / 'data'}",
            "data.synthetic.tasks=[copy]",
            "data.synthetic.max_size=4",
            "data.max_prompt_length=32",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.response_length=4",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "algorithm.adv_estimator=grpo",
        ],
    )
    trainer = GRPOTrainer(cfg)
    records = {}
    seen = _AdvantageStepRecorder()
    try:
        prompts = iter(trainer.loader)
        for name in supported_estimators():
            if name == "gae":
                continue  # needs the critic's worker group: tests/trainer/test_ppo_critic.py
            trainer.config.algorithm = AlgorithmSection(adv_estimator=name)
            records[name] = trainer.train_step(next(prompts))
            records[name]["advantage_step"] = seen.pop()
        trainer.config.algorithm = AlgorithmSection(adv_estimator="grpo")
        for mode in COV_MODES:  # the mini-batch-wide covariance selections, on sp=2 (verl's default ratios)
            trainer.actor.set_loss_mode(LossModeConfig(loss_mode=mode))
            records[mode] = trainer.train_step(next(prompts))
    finally:
        seen.restore()
        trainer.close()
    return records


class _AdvantageStepRecorder(list):
    """Wraps the trainer's advantage step: each call's batch columns and result are appended."""

    def __init__(self):
        from verl_balance.trainer import grpo_trainer
        from verl_balance.trainer.advantage_step import advantage_inputs

        super().__init__()
        self.module, self.original = grpo_trainer, grpo_trainer.compute_step_advantages

        def recording(batch, **kwargs):
            out = self.original(batch, **kwargs)
            self.append({"inputs": advantage_inputs(batch, **kwargs), "params": kwargs["algorithm"], "out": out})
            return out

        grpo_trainer.compute_step_advantages = recording

    def restore(self):
        self.module.compute_step_advantages = self.original


@pytest.mark.slow
def test_every_critic_free_estimator_runs_a_main_grpo_step_with_the_gspo_loss_on_sp2(algorithm_steps):
    assert set(algorithm_steps) == set(supported_estimators()) - {"gae"} | set(COV_MODES)
    for name, metrics in algorithm_steps.items():
        assert metrics["actor/num_optimizer_steps"] == 2, name
        assert math.isfinite(metrics["actor/loss"]) and math.isfinite(metrics["actor/grad_norm"]), name
    assert "reward/greedy_baseline_mean" in algorithm_steps["remax"]  # remax ran its greedy baseline rollout
    assert "reward/greedy_baseline_mean" not in algorithm_steps["grpo"]


@pytest.mark.slow
def test_clip_cov_and_kl_cov_run_main_grpo_steps_on_sp2(algorithm_steps):
    """Each selects max(1, int(ratio x N)) tokens of the mini-batch: clip_cov drops them (its pg_clipfrac is
    their share of the loss tokens, > 0 when a token is a candidate), kl_cov penalises them."""
    for mode in COV_MODES:
        metrics = algorithm_steps[mode]
        assert metrics["actor/num_optimizer_steps"] == 2, mode
        assert math.isfinite(metrics["actor/loss"]) and math.isfinite(metrics["actor/grad_norm"]), mode
    assert 0 <= algorithm_steps["clip_cov"]["actor/pg_clipfrac"] <= 0.5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baselines_read_the_old_log_prob_pass_sum_pi_squared(algorithm_steps, name):
    """The step's old log-prob pass carried sum_v pi^2 to the estimator: p(target)^2 <= it <= 1 on the
    loss tokens (the entropy, a log-prob or zeros would fail), and the step's advantages are the estimator's
    on these columns. The column's exactness is tests/algorithms/test_sum_pi_squared.py's."""
    record = algorithm_steps[name]["advantage_step"]
    inputs, params = record["inputs"], record["params"].advantage_params()
    mask = inputs.response_mask > 0
    spi2, old = inputs.sum_pi_squared[mask], inputs.old_log_probs[mask]
    assert mask.any() and bool((spi2 <= 1 + 1e-6).all()) and bool((spi2 >= old.exp().square() - 1e-6).all())
    assert bool((spi2 > 0).all())
    want = compute_advantage(adv_estimator=name, inputs=inputs, params=params)
    torch.testing.assert_close(record["out"].advantages, want.advantages, rtol=1e-6, atol=1e-7)


REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    base = float(sum(map(ord, solution_str)) % 3)
    # DAPO's metric: constant within the groups of prompts whose answer starts after "m"
    return {"score": base, "base": base, "dapo": base if str(ground_truth)[:1] <= "m" else 0.0}
"""
KL_CTRL = {"kl_coef": 0.05, "target_kl": 0.001, "horizon": 20}


@pytest.fixture(scope="module")
def dapo_steps(ray_cluster, tmp_path_factory):
    """Two main_grpo steps with verl's KL in the reward (adaptive), DAPO's dynamic sampling and overlong
    shaping, the decoupled rollout correction (token IS + rejection), then one bypass-mode step; the
    batch and scores each step hands to the advantage step are recorded."""
    import dataclasses

    from verl_balance.trainer.grpo_trainer import GRPOTrainer
    from verl_balance.trainer.verl_compat_keys import translate

    root = tmp_path_factory.mktemp("grpo_dapo")
    reward = root / "reward.py"
    reward.write_text(REWARD_FILE)
    verl_args, _ = translate(
        [
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=low_var_kl",
            "algorithm.kl_ctrl.type=adaptive",
            *(f"algorithm.kl_ctrl.{k}={v}" for k, v in KL_CTRL.items()),
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.metric=dapo",
            "algorithm.filter_groups.max_num_gen_batches=0",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=1.5",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.99999_1.00001",
            "reward_model.reward_manager=dapo",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.len=3",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=true",
            f"reward.custom_reward_function.path={reward}",
        ],
        recipe="grpo",
    )
    cfg = compose_config(
        "grpo",
        [
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=2",
            "trainer.logger=[jsonl]",
            "trainer.plot=false",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={root / 'run'}",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "data.synthetic.num_train=64",
            "data.synthetic.num_val=4",
            f"data.synthetic.out_dir={root / 'data'}",
            "data.synthetic.tasks=[copy]",
            "data.synthetic.max_size=4",
            "data.max_prompt_length=32",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.response_length=4",
            *verl_args,
        ],
    )
    trainer = GRPOTrainer(cfg)
    seen = []
    attach = trainer._attach_advantages

    def recording_attach(batch, scores, extras, **kwargs):
        rows = {"prompt_index": np.asarray(batch["prompt_index"]).copy(), "loss_mask": batch["loss_mask"].clone()}
        metrics = attach(batch, scores, extras, **kwargs)
        seen.append({**rows, "batch": batch, "scores": np.asarray(scores).copy(), "extras": dict(extras)})
        return metrics

    trainer._attach_advantages = recording_attach
    records, coefficients = [], []
    try:
        prompts = iter(trainer.loader)
        for _ in range(2):
            coefficients.append(trainer.kl_ctrl.value)
            records.append(trainer.train_step(next(prompts)))
        state = trainer._trainer_state()
        algorithm = trainer.config.algorithm
        trainer.config.algorithm = dataclasses.replace(
            algorithm, rollout_correction=RolloutCorrectionConfig(bypass_mode=True)
        )
        records.append(trainer.train_step(next(prompts)))
    finally:
        trainer.close()
    return {"records": records, "seen": seen, "coefficients": coefficients, "state": state}


@pytest.mark.slow
def test_kl_in_reward_runs_with_the_reference_policy_and_updates_the_adaptive_coefficient(dapo_steps):
    first, second = dapo_steps["records"][:2]
    for metrics in (first, second):
        assert metrics["actor/reward_kl_penalty"] >= 0  # low_var_kl
        assert metrics["train/old_log_prob_pass"] == 1.0 and "timing_s/ref" in metrics
    # verl's AdaptiveKLController: beta *= 1 + clip(kl / target - 1, -0.2, 0.2) * rows / horizon
    rows = len(dapo_steps["seen"][0]["scores"])
    error = np.clip(first["actor/reward_kl_penalty"] / KL_CTRL["target_kl"] - 1, -0.2, 0.2)
    assert first["actor/reward_kl_penalty_coeff"] == KL_CTRL["kl_coef"] == dapo_steps["coefficients"][0]
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(KL_CTRL["kl_coef"] * (1 + error * rows / 20))
    assert dapo_steps["state"]["kl_ctrl_in_reward_value"] != KL_CTRL["kl_coef"]  # checkpointed with the run


@pytest.mark.slow
def test_dynamic_sampling_trains_a_full_batch_of_groups_whose_metric_varies(dapo_steps):
    for step in dapo_steps["seen"][:2]:
        prompts = step["prompt_index"]
        assert sorted(set(prompts.tolist())) == [0, 1, 2, 3] and len(prompts) == 8  # train_batch_size x n
        for p in range(4):
            assert np.std(step["extras"]["dapo"][prompts == p]) > 0, p
    generated = [m["train/num_gen_batches"] for m in dapo_steps["records"][:2]]
    assert max(generated) >= 2  # negative control: some groups were dropped and more generated
    assert all(m["actor/num_optimizer_steps"] == 1 for m in dapo_steps["records"])


@pytest.mark.slow
def test_overlong_shaping_and_rollout_correction_reach_the_advantage_step(dapo_steps):
    for step, metrics in zip(dapo_steps["seen"][:2], dapo_steps["records"]):
        extras, batch = step["extras"], step["batch"]
        lengths = batch["response_lengths"].numpy()
        penalty = np.minimum(-(lengths - (4 - 3)) / 3 * 0.5, 0)
        np.testing.assert_allclose(extras["overlong_reward"], penalty, rtol=1e-6)
        np.testing.assert_allclose(step["scores"], extras["base"] + penalty, rtol=1e-6)
        assert "reward/overlong_reward" in metrics
        assert "rollout_is_weights" in batch and "rollout_corr/rollout_is_mean" in metrics
        # the rejected tokens (token_k1 outside [log 0.99999, log 1.00001]) left the loss mask
        _, kept, _ = decoupled_correction(
            old_log_probs=batch["old_log_probs"],
            rollout_log_probs=batch["rollout_log_probs"],
            loss_mask=step["loss_mask"],
            config=RolloutCorrectionConfig(rollout_rs="token_k1", rollout_rs_threshold="0.99999_1.00001"),
        )
        assert torch.equal(batch["loss_mask"], kept)
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(
            float(1 - kept.sum() / step["loss_mask"].sum()), abs=1e-6
        )
        assert math.isfinite(metrics["actor/loss"])


@pytest.mark.slow
def test_bypass_mode_takes_the_rollouts_log_probs_as_the_old_ones(dapo_steps):
    bypass, batch = dapo_steps["records"][2], dapo_steps["seen"][2]["batch"]
    assert "timing_s/old_log_prob" not in bypass and "timing_s/old_log_prob" in dapo_steps["records"][0]
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    assert math.isfinite(bypass["actor/loss"]) and "rollout_corr/rollout_is_mean" not in bypass
