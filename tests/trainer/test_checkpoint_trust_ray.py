"""Trainer runs on CPU Ray workers (slow): SIGTERM stops a run with the same save as Ctrl-C and
a resume continues the curve exactly; a received checkpoint with a planted payload (DCP metadata or
engine state, its manifest rewritten by the attacker) is refused on ``resume_path`` and on the
GRPO warm start, and the payload never runs; a 2-layer checkpoint warm-starting a 1-layer actor is
refused naming ``warm_start_path`` and the layer's keys.

One straight SFT run (checkpoints at steps 2 and 4; the shared ``sft_reference_runs``, copied) is the
reference curve and the source of the received checkpoints. References: the straight run's metrics;
a marker directory only the payload would create (tests/trainer/test_checkpoint_trust.py shows the
plain readers creating it).
"""

from __future__ import annotations

import os
import shutil
import signal

import numpy as np
import pytest

from tests.trainer.conftest import compose_config
from tests.trainer.test_checkpoint_trust import plant_engine_state, plant_metadata
from verl_balance.trainer.driver import exit_code
from verl_balance.utils.tracking import read_metrics

pytestmark = pytest.mark.slow  # Ray workers


def _sft(overrides: list[str], *, sigterm_in_step: int | None = None) -> tuple[dict, list[dict]]:
    """(summary, metrics records) of one SFT run; ``sigterm_in_step=k``: SIGTERM arrives during step k."""
    from verl_balance.trainer.sft_trainer import SFTTrainer

    trainer = SFTTrainer(compose_config("sft", overrides))
    if sigterm_in_step is not None:
        step = trainer.train_step

        def train_step_then_sigterm(batch):
            metrics = step(batch)
            if trainer.global_step + 1 == sigterm_in_step:
                os.kill(os.getpid(), signal.SIGTERM)  # what SLURM / Kubernetes send: handled after this step
            return metrics

        trainer.train_step = train_step_then_sigterm
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return summary, read_metrics(summary["metrics"])


@pytest.fixture(scope="module")
def runs(sft_reference_runs, tmp_path_factory):
    """The shared straight run (checkpoints at steps 2 and 4) and this module's SIGTERM-stopped run resumed."""
    root = tmp_path_factory.mktemp("trust")
    shutil.copytree(sft_reference_runs["root"] / "straight", root / "straight")
    base = sft_reference_runs["base"]
    resumed_dir = root / "resumed"
    stopped = _sft(base + [f"trainer.default_local_dir={resumed_dir}", "trainer.resume_mode=auto"], sigterm_in_step=3)
    latest_after_stop = (resumed_dir / "latest_checkpointed_iteration.txt").read_text()
    resumed = _sft(base + [f"trainer.default_local_dir={resumed_dir}", "trainer.resume_mode=auto"])
    straight = sft_reference_runs["straight"]
    return {
        "root": root,
        "base": base,
        "straight": straight,
        "stopped": stopped,
        "latest_after_stop": latest_after_stop,
        "resumed": resumed,
    }


def test_sigterm_saves_and_exits_143_and_the_resume_continues_the_curve_exactly(runs):
    (summary, first), (_, resumed), (_, straight) = runs["stopped"], runs["resumed"], runs["straight"]
    assert [r["step"] for r in first] == [1, 2, 3], "SIGTERM must stop after the current step"
    assert summary["stop_signal"] == "SIGTERM" and exit_code(summary) == 143
    assert runs["latest_after_stop"] == "3"  # save_freq=2: the step-3 checkpoint is the one the stop saved
    assert exit_code(runs["straight"][0]) == 0, "a finished run exits 0"
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("train/loss", "train/grad_norm"):
        np.testing.assert_allclose([r[key] for r in resumed], [r[key] for r in straight], rtol=1e-6)


def test_running_a_finished_run_again_resumes_at_its_end_and_summarizes_its_curve(runs):
    from verl_balance.trainer.sft_trainer import format_summary

    finished = runs["root"] / "finished_twice"
    shutil.copytree(runs["root"] / "straight", finished)
    summary, records = _sft(runs["base"] + [f"trainer.default_local_dir={finished}", "trainer.resume_mode=auto"])
    straight = runs["straight"][1]
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 4 and exit_code(summary) == 0
    assert [r["step"] for r in records] == [r["step"] for r in straight], "no step runs twice"
    train = [r for r in straight if "train/loss" in r]
    assert (summary["first_loss"], summary["final_loss"]) == (train[0]["train/loss"], train[-1]["train/loss"])
    text = format_summary(summary)
    assert f"-> final {train[-1]['train/loss']:.4f}" in text and "the run had finished" in text


def _received(runs, name: str) -> str:
    """A copy of the straight run's step-2 checkpoint, as a user receives it."""
    copy = runs["root"] / "received" / name / "global_step_2"
    shutil.copytree(runs["root"] / "straight" / "global_step_2", copy)
    return str(copy)


@pytest.mark.parametrize("planted", ["metadata", "engine_state"])
def test_resume_path_refuses_a_planted_payload_and_it_never_runs(runs, planted):
    ckpt = _received(runs, planted)
    marker = str(runs["root"] / f"ran_{planted}")
    (plant_metadata if planted == "metadata" else plant_engine_state)(ckpt, marker)
    overrides = runs["base"] + [
        f"trainer.default_local_dir={runs['root'] / f'resume_{planted}'}",
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={ckpt}",
    ]
    name = ".metadata" if planted == "metadata" else "engine_state.pt"
    with pytest.raises(Exception, match=rf"{os.path.join(ckpt, name)} is refused"):
        _sft(overrides)
    assert not os.path.exists(marker)


def _grpo(runs, name: str, extra: list[str]) -> None:
    from verl_balance.trainer.config.grpo import register_grpo_schema
    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    register_grpo_schema()
    root = runs["root"]
    overrides = [
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        "trainer.total_training_steps=1",
        "data.synthetic.num_train=16",
        "data.synthetic.num_val=8",
        f"data.synthetic.out_dir={root / 'rl_data'}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=4",
        f"trainer.default_local_dir={root / name}",
        *extra,
    ]
    trainer = GRPOTrainer(compose_config("grpo", overrides))
    try:
        trainer.fit()
    finally:
        trainer.close()


def test_grpo_warm_start_refuses_a_planted_payload_and_it_never_runs(runs):
    ckpt = _received(runs, "warm")
    marker = str(runs["root"] / "ran_warm")
    plant_metadata(ckpt, marker)
    with pytest.raises(Exception, match=rf"{os.path.join(ckpt, '.metadata')} is refused"):
        _grpo(runs, "warm_planted", [f"actor_rollout_ref.model.warm_start_path={ckpt}"])
    assert not os.path.exists(marker)


def test_a_two_layer_checkpoint_warm_starting_a_one_layer_actor_is_refused_naming_the_keys(runs):
    ckpt = str(runs["root"] / "straight" / "global_step_2")  # the tiny preset: 2 layers
    with pytest.raises(Exception, match=r"warm_start_path=.*does not fit.*unexpected.*layers\.1\."):
        _grpo(
            runs,
            "warm_1_layer",
            [f"actor_rollout_ref.model.warm_start_path={ckpt}", "actor_rollout_ref.model.num_layers=1"],
        )
