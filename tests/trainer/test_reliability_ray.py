"""Fault and reproducibility tests on an embedded Ray cluster: worker restarts and layout-independent rollouts.

References: a restarted run is compared with an uninterrupted run of the same config; a GRPO run
on 4 workers is compared with the same run on 2 workers.
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from tests.trainer.conftest import compose_config
from verl_balance.single_controller import WorkerDiedError
from verl_balance.utils.tracking import read_metrics

pytestmark = pytest.mark.slow


def _sft_trainer(overrides, *, kill_before_step: int | None = None):
    """An SFTTrainer whose worker rank 1 is SIGKILLed just before step ``kill_before_step`` (once)."""
    import ray

    from verl_balance.trainer.sft_trainer import SFTTrainer

    trainer = SFTTrainer(compose_config("sft", overrides))
    if kill_before_step is not None:
        step, killed = trainer.train_step, []

        def train_step_after_killing_a_worker(tensors):
            if trainer.global_step + 1 == kill_before_step and not killed:
                pid = ray.get(trainer.actor.workers[1].get_rank_info.remote())["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            return step(tensors)

        trainer.train_step = train_step_after_killing_a_worker
    return trainer


def test_worker_killed_mid_run_restarts_from_the_checkpoint_and_matches_the_uninterrupted_curve(
    sft_reference_runs, tmp_path
):
    # The uninterrupted curve: the shared reference run (4 steps, checkpoints at steps 2 and 4).
    expected = sft_reference_runs["straight"][1]
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    healed = _sft_trainer(
        sft_reference_runs["base"] + [f"trainer.default_local_dir={tmp_path / 'healed'}", "trainer.max_restarts=1"],
        kill_before_step=4,
    )  # step 3 is logged but not saved: it must be redone
    try:
        summary = healed.fit()
    finally:
        healed.close()
    records = read_metrics(str(tmp_path / "healed"))
    assert summary["restarts"] == 1 and summary["steps"] == 4
    raw_steps = [json.loads(line)["step"] for line in (tmp_path / "healed" / "metrics.jsonl").read_text().splitlines()]
    assert raw_steps == [1, 2, 3, 4], "the step logged after the checkpoint is cut back, then logged once"
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["train/loss"] for r in records], [r["train/loss"] for r in expected], rtol=1e-6)
    np.testing.assert_allclose(
        [r["train/grad_norm"] for r in records], [r["train/grad_norm"] for r in expected], rtol=1e-6
    )


def test_without_max_restarts_a_killed_worker_ends_the_run(ray_cluster, tiny_sft_overrides, tmp_path):
    """Negative control for the restart test: max_restarts=0 (the default) keeps today's behaviour."""
    overrides = [o for o in tiny_sft_overrides if not o.startswith("trainer.default_local_dir")]
    trainer = _sft_trainer(
        overrides
        + [
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.n_gpus_per_node=2",
            "trainer.total_training_steps=2",
        ],
        kill_before_step=1,
    )
    try:
        with pytest.raises(WorkerDiedError):
            trainer.fit()
    finally:
        trainer.close()


def test_grpo_rollouts_and_losses_are_identical_on_2_and_4_workers(ray_cluster, tmp_path):
    from verl_balance.trainer.config.grpo import register_grpo_schema
    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    register_grpo_schema()
    base = [
        "trainer.device=cpu",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        "data.synthetic.num_train=64",
        "data.synthetic.num_val=8",
        f"data.synthetic.out_dir={tmp_path / 'data'}",
        "data.synthetic.tasks=[copy]",
        "data.synthetic.max_size=6",
        "data.max_prompt_length=32",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.response_length=8",
        "trainer.total_training_steps=3",
        "trainer.val_before_train=false",  # every recorded rollout is a training step's
        "actor_rollout_ref.actor.optim.lr=1e-2",
    ]
    responses, losses = {}, {}
    for workers in (2, 4):
        trainer = GRPOTrainer(
            compose_config(
                "grpo",
                base + [f"trainer.n_gpus_per_node={workers}", f"trainer.default_local_dir={tmp_path / f'w{workers}'}"],
            )
        )
        generate, seen = trainer.generate, []

        def generate_and_record(*args, _generate=generate, _seen=seen, **kwargs):
            batch = _generate(*args, **kwargs)
            _seen.append(batch["input_ids"].clone())
            return batch

        trainer.generate = generate_and_record
        try:
            summary = trainer.fit()
        finally:
            trainer.close()
        responses[workers] = seen
        losses[workers] = [r["actor/loss"] for r in read_metrics(summary["metrics"])]
    assert len(responses[2]) == len(responses[4]) == 3
    for step, (two, four) in enumerate(zip(responses[2], responses[4]), start=1):
        assert two.shape == four.shape and bool((two == four).all()), f"step {step}: responses differ"
    np.testing.assert_allclose(losses[4], losses[2], rtol=1e-5)
