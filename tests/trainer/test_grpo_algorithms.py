"""main_grpo with verl's algorithm set on the synthetic task: ONE trainer (one worker group, the session
Ray cluster) whose steps run every estimator in turn, with a loss mode that needs the engine's
SP-reduced sequence sums (gspo). The estimator is driver-side state, so switching it between steps
runs each one through the trainer's real rollout, scoring, log-prob and update path."""

from __future__ import annotations

import math

import pytest

from tests.trainer.conftest import compose_config
from verl_balance.trainer.algorithm_config import AlgorithmSection, supported_estimators
from verl_balance.trainer.grpo_config import register_grpo_schema

register_grpo_schema()


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
    try:
        prompts = iter(trainer.loader)
        for name in supported_estimators():
            if name == "gae":
                continue  # needs the critic's worker group: tests/trainer/test_ppo_critic.py
            trainer.config.algorithm = AlgorithmSection(adv_estimator=name)
            records[name] = trainer.train_step(next(prompts))
    finally:
        trainer.close()
    return records


@pytest.mark.slow
def test_every_critic_free_estimator_runs_a_main_grpo_step_with_the_gspo_loss_on_sp2(algorithm_steps):
    assert set(algorithm_steps) == set(supported_estimators()) - {"gae"}
    for name, metrics in algorithm_steps.items():
        assert metrics["actor/num_optimizer_steps"] == 2, name
        assert math.isfinite(metrics["actor/loss"]) and math.isfinite(metrics["actor/grad_norm"]), name
    assert "reward/greedy_baseline_mean" in algorithm_steps["remax"]  # remax ran its greedy baseline rollout
    assert "reward/greedy_baseline_mean" not in algorithm_steps["grpo"]
