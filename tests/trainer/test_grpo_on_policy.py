"""On-policy GRPO steps skip the old-log-prob pass (actor.recompute_old_log_prob=auto) exactly.

Reference: the same run with ``recompute_old_log_prob=always`` (verl's behaviour: a separate
old-log-prob pass every step). Over 3 steps the logged losses, gradient norms, entropy and KL must
agree to rtol 1e-6 while only the reference runs the pass; the shortcut must not be taken when the
update is off-policy (several PPO epochs; several mini-batches is checked on the shared run in
test_grpo_trainer.py); and the shortcut keeps GRPO's layout invariance (2 vs 4 workers).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer.conftest import compose_config
from tests.trainer.test_grpo_trainer import LETTER_REWARD
from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo
from verl_balance.utils.tracking import read_metrics

COMPARED = ("actor/loss", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss")


def _base(root) -> list[str]:
    """2-3 step runs with a reward a random policy scores unevenly (non-zero advantages)."""
    reward_file = root / "letters.py"
    reward_file.write_text(LETTER_REWARD)
    return [
        f"custom_reward_function.path={reward_file}",
        "trainer.device=cpu",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        "trainer.val_before_train=false",  # every recorded rollout is a training step's
        "data.synthetic.num_train=64",
        "data.synthetic.num_val=8",
        f"data.synthetic.out_dir={root / 'data'}",
        "data.synthetic.tasks=[copy]",
        "data.synthetic.max_size=6",
        "data.max_prompt_length=32",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.response_length=8",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
    ]


def _run(overrides: list[str]) -> tuple[list[dict], list]:
    """Train; the step records and each step's rollout token ids."""
    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    register_grpo_schema()
    trainer = GRPOTrainer(compose_config("grpo", overrides))
    generate, seen = trainer.generate, []

    def generate_and_record(*args, **kwargs):
        batch = generate(*args, **kwargs)
        seen.append(batch["input_ids"].clone())
        return batch

    trainer.generate = generate_and_record
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return [r for r in read_metrics(summary["metrics"]) if r["step"] >= 1], seen


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], True),
        (["actor_rollout_ref.actor.recompute_old_log_prob=always"], False),
        (["actor_rollout_ref.actor.ppo_epochs=2"], False),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], False),
        (["actor_rollout_ref.actor.use_dynamic_bsz=true"], True),  # micro-batching does not matter
    ],
)
def test_old_log_probs_come_from_the_update_only_for_one_epoch_and_one_mini_batch(tmp_path, overrides, expected):
    register_grpo_schema()
    cfg = compose_config("grpo", _base(tmp_path) + [f"trainer.default_local_dir={tmp_path}"] + overrides)
    config = validate_grpo(cfg)
    actor = config.actor_rollout_ref.actor
    assert actor.single_on_policy_update(train_batch_size=config.data.train_batch_size) is expected


@pytest.mark.slow
def test_skipping_the_old_log_prob_pass_gives_the_full_pass_losses_and_keeps_layout_invariance(ray_cluster, tmp_path):
    base = _base(tmp_path) + ["trainer.total_training_steps=3"]
    runs = {}
    for name, extra in {
        "auto_2": ["trainer.n_gpus_per_node=2"],
        "always_2": ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.recompute_old_log_prob=always"],
        "auto_4": ["trainer.n_gpus_per_node=4"],
    }.items():
        runs[name] = _run(base + extra + [f"trainer.default_local_dir={tmp_path / name}"])
    (auto, auto_rollouts), (full, full_rollouts), (auto4, auto4_rollouts) = runs.values()
    assert len(auto) == len(full) == len(auto4) == 3

    for step in full:  # the reference really ran the pass ...
        assert step["train/old_log_prob_pass"] == 1.0 and "timing_s/old_log_prob" in step
    for step in auto + auto4:  # ... and the shortcut did not, with the metrics of ratio == 1
        assert step["train/old_log_prob_pass"] == 0.0 and "timing_s/old_log_prob" not in step
        assert step["actor/pg_clipfrac"] == 0.0 and step["actor/ppo_kl"] == 0.0
        assert "timing_s/ref" in step  # the reference pass still runs (use_kl_loss)
    for step in auto + full:
        assert 0 <= step["training/rollout_probs_diff_mean"] <= step["training/rollout_probs_diff_max"] < 1e-4

    for step, (a, f) in enumerate(zip(auto_rollouts, full_rollouts), start=1):
        assert a.shape == f.shape and bool((a == f).all()), f"step {step}: rollouts differ"
    for key in COMPARED:
        np.testing.assert_allclose([r[key] for r in auto], [r[key] for r in full], rtol=1e-6, err_msg=key)
    # The comparison is not vacuous: real gradients, and steps that differ by far more than rtol.
    grad_norms = [r["actor/grad_norm"] for r in full]
    assert min(grad_norms) > 1e-3, grad_norms
    assert not np.allclose(grad_norms[1:], grad_norms[:-1], rtol=1e-3), grad_norms

    for step, (two, four) in enumerate(zip(auto_rollouts, auto4_rollouts), start=1):
        assert two.shape == four.shape and bool((two == four).all()), f"step {step}: responses differ on 4 workers"
    # Group-normalised advantages sum to 0, so pg_loss (and loss) is ~1e-9 of round-off at step 1:
    # compared with an absolute floor; the gradient norm carries the update itself.
    for key in COMPARED:
        atol = 1e-7 if key in ("actor/loss", "actor/pg_loss") else 0.0
        four, two = [r[key] for r in auto4], [r[key] for r in auto]
        np.testing.assert_allclose(four, two, rtol=1e-5, atol=atol, err_msg=key)


@pytest.mark.slow
def test_several_ppo_epochs_run_the_old_log_prob_pass(ray_cluster, tmp_path):
    records, _ = _run(
        _base(tmp_path)
        + [
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=1",
            "actor_rollout_ref.actor.ppo_epochs=2",
            f"trainer.default_local_dir={tmp_path / 'run'}",
        ]
    )
    (step,) = records
    assert step["train/old_log_prob_pass"] == 1.0 and "timing_s/old_log_prob" in step
    assert step["actor/num_optimizer_steps"] == 2
    # The second epoch's update is off-policy: its ratio moved away from 1 (the first epoch's is 1).
    assert step["actor/ppo_kl"] != 0.0
