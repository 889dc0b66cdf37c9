"""main_grpo with verl's algorithm set on the synthetic task: ONE trainer (one worker group, the session
Ray cluster) whose steps run a schedule derived from the registries: every critic-free estimator runs
STEPS_PER_ENTRY consecutive steps, paired with engine loss mode i mod n, so every loss mode runs at least
STEPS_PER_ENTRY steps too (about 3 x max(#estimators, #modes) steps, not their product). The estimator is
driver-side state and the loss mode the workers' (``ActorWorker.set_loss_mode``), so switching them
between steps runs each through the trainer's real rollout, scoring, log-prob and update path on sp=2."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config
from verl_balance.algorithms import LOSS_MODE_REGISTRY, LossModeConfig, PolicyLossConfig, compute_advantage
from verl_balance.algorithms.loss_modes import policy_token_loss
from verl_balance.algorithms.loss_reductions import reference_reductions
from verl_balance.algorithms.rollout_correction import RolloutCorrectionConfig, decoupled_correction
from verl_balance.trainer.config.algorithm import (
    ENGINE_LOSS_MODES,
    AlgorithmSection,
    PolicyLossSection,
    supported_estimators,
)
from verl_balance.trainer.config.checks import ConfigError
from verl_balance.trainer.config.grpo import register_grpo_schema

register_grpo_schema()
COV_MODES = ("clip_cov", "kl_cov")
STEPS_PER_ENTRY = 3
CRITIC_ESTIMATORS = ("gae",)  # needs the critic's worker group: tests/trainer/test_ppo_critic.py (3 steps)
ESTIMATORS = tuple(name for name in supported_estimators() if name not in CRITIC_ESTIMATORS)
SCHEDULE = tuple(
    (ESTIMATORS[i % len(ESTIMATORS)], ENGINE_LOSS_MODES[i % len(ENGINE_LOSS_MODES)])
    for i in range(max(len(ESTIMATORS), len(ENGINE_LOSS_MODES)))
)
"""(estimator, loss mode) entries, each run for STEPS_PER_ENTRY consecutive steps."""
MODE_METRICS = ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")
"""The per-token metrics a loss mode may return (which of them it returns is its signature)."""
SCORE_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(map(ord, solution_str)) % 97) / 97.0  # varies within a group: non-zero advantages
"""


@pytest.fixture(scope="module")
def algorithm_steps(ray_cluster, tmp_path_factory):
    """{"steps": one record per step (estimator, loss mode, metrics, advantage step, the ranks' describe(),
    the probe's log-prob change), "probe_repeat_change": the probe's change with no step in between}."""
    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    root = tmp_path_factory.mktemp("grpo_algorithms")
    score = root / "score.py"
    score.write_text(SCORE_FILE)
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
            f"custom_reward_function.path={score}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            # sapo and geo_mean force it (as verl does): the aggregation every scheduled mode gets in main_grpo
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            "actor_rollout_ref.actor.policy_loss.dro_beta=0.1",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.response_length=4",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
            "algorithm.adv_estimator=grpo",
        ],
    )
    trainer = GRPOTrainer(cfg)
    seen = _AdvantageStepRecorder()
    try:
        return _run_schedule(trainer, seen)
    finally:
        seen.restore()
        trainer.close()


def _run_schedule(trainer, seen) -> dict:
    """SCHEDULE's steps, the probe's log-probs before the first and after each, each entry's describe()."""
    prompts = _epochs(trainer.loader)
    probe = _probe_batch(trainer, next(prompts))
    # Submitted, not awaited: a Ray actor runs its calls in submission order, so each probe reads the
    # weights between its step and the next while the driver goes on (no round trip per step).
    probes = [_submit_probe(trainer, probe), _submit_probe(trainer, probe)]
    steps, entries = [], []
    for estimator, mode in SCHEDULE:
        trainer.config.algorithm = AlgorithmSection(adv_estimator=estimator)
        section = _main_grpo_actor_section(trainer.actor_cfg, mode)
        trainer.actor.set_loss_mode(section.loss_mode_config())
        for _ in range(STEPS_PER_ENTRY):
            metrics = trainer.train_step(next(prompts))
            probes.append(_submit_probe(trainer, probe))
            steps.append({"metrics": metrics, "advantage_step": seen.pop(), "estimator": estimator})
            steps[-1].update(loss_mode=mode, agg_mode=section.loss_agg_mode)
            steps[-1]["mode_config"] = dataclasses.asdict(section.loss_mode_config())
        entries.append(trainer.actor.describe.submit())  # after the entry: the mode its steps trained with
    log_probs = [_probe_result(p) for p in probes]
    ranks = [e.get() for e in entries]
    for k, step in enumerate(steps):
        step["probe_change"] = float((log_probs[k + 2] - log_probs[k + 1]).abs().max())
        step["ranks"] = ranks[k // STEPS_PER_ENTRY]
    return {"steps": steps, "probe_repeat_change": float((log_probs[1] - log_probs[0]).abs().max())}


def _epochs(loader):
    """The loader's prompt batches, epoch after epoch (the schedule is longer than one epoch)."""
    while True:
        yield from loader


def _main_grpo_actor_section(actor, mode: str):
    """The actor section main_grpo builds with ``policy_loss.loss_mode=mode`` over the fixture's keys
    (its __post_init__ forces sapo's / geo_mean's aggregation and checks the mode's settings)."""
    return dataclasses.replace(actor, policy_loss=dataclasses.replace(actor.policy_loss, loss_mode=mode))


def _probe_batch(trainer, prompts):
    """A fixed batch of responses whose log-probs are taken after every step (weights changed or not)."""
    from verl_balance.batch_keys import TEMPERATURE_KEY

    batch = trainer.generate(prompts, n=1, temperature=1.0, top_p=1.0, seed=7)
    batch.meta[TEMPERATURE_KEY] = 1.0
    return batch


def _submit_probe(trainer, probe):
    """Start the actor's log-prob pass over the probe, planned as the old log-prob pass is: (plan, future)."""
    from verl_balance.trainer.grpo.trainer import LOG_PROB_INPUT_KEYS
    from verl_balance.trainer.plan_dispatch import split_by_plan

    plan = trainer._plan(probe, micro_batch_size=4, token_cap=None)
    chunks = split_by_plan(probe.select(batch_keys=LOG_PROB_INPUT_KEYS, non_tensor_batch_keys=[]), plan)
    return plan, trainer.actor.compute_log_prob.submit(chunks)


def _probe_result(pending) -> torch.Tensor:
    """The probe's per-token log-probs in row order."""
    from verl_balance.batch_keys import LOG_PROBS_KEY
    from verl_balance.trainer.plan_dispatch import merge_by_plan

    plan, future = pending
    return merge_by_plan(future.get(), plan)[LOG_PROBS_KEY]


class _AdvantageStepRecorder(list):
    """Wraps the trainer's advantage step: each call's batch columns and result are appended."""

    def __init__(self):
        from verl_balance.trainer.grpo import trainer as grpo_trainer
        from verl_balance.trainer.grpo.advantage_step import advantage_inputs

        super().__init__()
        self.module, self.original = grpo_trainer, grpo_trainer.compute_step_advantages

        def recording(batch, **kwargs):
            out = self.original(batch, **kwargs)
            self.append({"inputs": advantage_inputs(batch, **kwargs), "params": kwargs["algorithm"], "out": out})
            return out

        grpo_trainer.compute_step_advantages = recording

    def restore(self):
        self.module.compute_step_advantages = self.original


def _steps_of(algorithm_steps, *, estimator=None, loss_mode=None) -> list[dict]:
    steps = [
        s
        for s in algorithm_steps["steps"]
        if estimator in (None, s["estimator"]) and loss_mode in (None, s["loss_mode"])
    ]
    assert steps, (estimator, loss_mode)
    return steps


def _mode_signature(mode: str) -> set[str]:
    """Which of MODE_METRICS the mode's per-token loss returns, from the single-process reference."""
    config, loss_mode = PolicyLossConfig(), LossModeConfig(loss_mode=mode, dro_beta=0.1)
    log_probs, old = torch.tensor([[-1.0, -2.0, -0.5]]), torch.tensor([[-1.1, -1.9, -0.5]])
    advantages, mask = torch.tensor([[1.0, 1.0, 1.0]]), torch.ones(1, 3)
    reduced = reference_reductions(
        log_probs=log_probs, old_log_probs=old, advantages=advantages, loss_mask=mask, config=config, mode=loss_mode
    )
    _, metrics = policy_token_loss(
        log_probs=log_probs, old_log_probs=old, advantages=advantages, config=config, mode=loss_mode, reduced=reduced
    )
    return set(metrics) & set(MODE_METRICS)


def test_the_schedule_runs_every_estimator_and_every_engine_loss_mode_three_steps():
    """Derived from the registries, so a mode or estimator added later joins (or this fails naming it);
    a registered mode main_grpo does not run must be refused at start-up naming the key."""
    entries = [e for e in SCHEDULE for _ in range(STEPS_PER_ENTRY)]
    for estimator in supported_estimators():
        assert estimator in CRITIC_ESTIMATORS or sum(e == estimator for e, _ in entries) >= STEPS_PER_ENTRY, estimator
    for mode in LOSS_MODE_REGISTRY:
        if sum(m == mode for _, m in entries) >= STEPS_PER_ENTRY:
            continue
        with pytest.raises(ConfigError, match="loss_mode"):  # not scheduled: main_grpo must refuse it
            PolicyLossSection(loss_mode=mode)
    assert len(entries) == STEPS_PER_ENTRY * max(len(ESTIMATORS), len(ENGINE_LOSS_MODES))


@pytest.mark.slow
def test_every_critic_free_estimator_runs_three_main_grpo_steps_on_sp2(algorithm_steps):
    steps = algorithm_steps["steps"]
    assert {s["estimator"] for s in steps} == set(supported_estimators()) - set(CRITIC_ESTIMATORS)
    assert len(steps) == STEPS_PER_ENTRY * len(SCHEDULE)
    for step in steps:
        metrics, name = step["metrics"], (step["estimator"], step["loss_mode"])
        assert metrics["actor/num_optimizer_steps"] == 2, name
        assert math.isfinite(metrics["actor/loss"]) and math.isfinite(metrics["actor/grad_norm"]), name
        assert math.isfinite(metrics["actor/pg_loss"]) and metrics["actor/step_skipped"] == 0, name
    for estimator, _ in SCHEDULE:  # consecutive steps of one estimator
        runs = [s["estimator"] == estimator for s in steps]
        first = runs.index(True)
        assert runs[first : first + STEPS_PER_ENTRY] == [True] * STEPS_PER_ENTRY, estimator
    for step in _steps_of(algorithm_steps, estimator="remax"):  # remax ran its greedy baseline rollout
        assert "reward/greedy_baseline_mean" in step["metrics"]
    for step in _steps_of(algorithm_steps, estimator="grpo"):
        assert "reward/greedy_baseline_mean" not in step["metrics"]


@pytest.mark.slow
def test_every_step_moves_the_weights(algorithm_steps):
    """The probe's log-probs change at every step (the advantages are non-zero, the optimizer steps);
    taken twice with no step in between they are equal, so the comparison can fail."""
    assert algorithm_steps["probe_repeat_change"] == 0.0
    for step in algorithm_steps["steps"]:
        name = (step["estimator"], step["loss_mode"])
        assert step["probe_change"] > 0, name
        assert step["metrics"]["actor/grad_norm"] > 0, name
        assert bool((step["advantage_step"]["out"].advantages != 0).any()), name


@pytest.mark.slow
def test_every_engine_loss_mode_runs_three_main_grpo_steps_as_main_grpo_configures_it(algorithm_steps):
    """Every rank reports the step's mode with main_grpo's settings for it and the aggregation main_grpo
    gives it (sapo, geo_mean: seq-mean-token-mean); the step's metrics are the mode's signature (gpg
    returns none of MODE_METRICS, dro / kl_cov ppo_kl only, clip_cov no pg_clipfrac_lower: a step that
    ran the start-up mode gspo instead would fail)."""
    for mode in ENGINE_LOSS_MODES:
        steps = _steps_of(algorithm_steps, loss_mode=mode)
        assert len(steps) >= STEPS_PER_ENTRY, mode
        signature = _mode_signature(mode)
        for step in steps:
            for rank in step["ranks"]:
                assert rank["loss_mode"]["loss_mode"] == mode, (mode, rank["rank"])
                assert rank["loss_mode"] == step["mode_config"], (mode, rank["rank"])
                assert rank["engine"]["loss_agg_mode"] == step["agg_mode"], (mode, rank["rank"])
            logged = {k for k in MODE_METRICS if f"actor/{k}" in step["metrics"]}
            assert logged == signature, (mode, logged, signature)
    assert {_steps_of(algorithm_steps, loss_mode=m)[0]["agg_mode"] for m in ("sapo", "geo_mean")} == {
        "seq-mean-token-mean"
    }
    assert _mode_signature("gpg") != _mode_signature("gspo")  # the signature tells the start-up mode apart


@pytest.mark.slow
def test_clip_cov_and_kl_cov_run_main_grpo_steps_on_sp2(algorithm_steps):
    """Each selects max(1, int(ratio x N)) tokens of the mini-batch: clip_cov drops them (its pg_clipfrac is
    their share of the loss tokens, > 0 when a token is a candidate), kl_cov penalises them."""
    for mode in COV_MODES:
        for step in _steps_of(algorithm_steps, loss_mode=mode):
            metrics = step["metrics"]
            assert metrics["actor/num_optimizer_steps"] == 2, mode
            assert math.isfinite(metrics["actor/loss"]) and math.isfinite(metrics["actor/grad_norm"]), mode
    for step in _steps_of(algorithm_steps, loss_mode="clip_cov"):
        assert 0 <= step["metrics"]["actor/pg_clipfrac"] <= 0.5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baselines_read_the_old_log_prob_pass_sum_pi_squared(algorithm_steps, name):
    """The step's old log-prob pass carried sum_v pi^2 to the estimator: p(target)^2 <= it <= 1 on the
    loss tokens (the entropy, a log-prob or zeros would fail), and the step's advantages are the estimator's
    on these columns. The column's exactness is tests/algorithms/test_sum_pi_squared.py's."""
    for step in _steps_of(algorithm_steps, estimator=name):
        record = step["advantage_step"]
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
    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    root = tmp_path_factory.mktemp("grpo_dapo")
    reward = root / "reward.py"
    reward.write_text(REWARD_FILE)
    verl_args = [
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
    ]
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
            "data.synthetic.num_train=256",  # dynamic sampling draws extra batches from the same loader
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
    records, coefficients, modes = [], [], []
    try:
        prompts = iter(trainer.loader)
        for _ in range(2):
            coefficients.append(trainer.kl_ctrl.value)
            records.append(trainer.train_step(next(prompts)))
        state = trainer._trainer_state()
        algorithm = trainer.config.algorithm
        for correction in (
            RolloutCorrectionConfig(bypass_mode=True),  # ppo_clip: the ratio against the rollout is the correction
            RolloutCorrectionConfig(bypass_mode=True, loss_type="reinforce", rollout_is="sequence"),
        ):
            trainer.config.algorithm = dataclasses.replace(algorithm, rollout_correction=correction)
            trainer.actor.set_loss_mode(trainer.config.loss_mode_config())  # as main_grpo builds the workers
            records.append(trainer.train_step(next(prompts)))
            modes.append(trainer.actor.describe()[0]["loss_mode"])
    finally:
        trainer.close()
    return {"records": records, "seen": seen, "coefficients": coefficients, "state": state, "modes": modes}


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


@pytest.mark.slow
def test_the_bypass_steps_train_verls_bypass_loss_mode_and_reinforce_logs_its_sequence_is_weights(dapo_steps):
    ppo_clip, reinforce = dapo_steps["modes"]
    assert ppo_clip["loss_mode"] == reinforce["loss_mode"] == "bypass_mode"
    assert ppo_clip["rollout_correction"]["loss_type"] == "ppo_clip"
    assert reinforce["rollout_correction"]["loss_type"] == "reinforce"
    metrics, batch = dapo_steps["records"][3], dapo_steps["seen"][3]["batch"]
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"]) and "timing_s/old_log_prob" not in metrics
    assert math.isfinite(metrics["actor/loss"]) and 0 < metrics["rollout_corr/rollout_is_mean"] <= 2.0
