"""main_grpo's trainer with ``actor_rollout_ref.rollout.name=vllm``: dp2 on CPU, a Qwen3-shaped HF directory.

Each of the two actor workers holds an in-process vLLM engine fed from the FSDP2 shards bucket by
bucket. The trainer's recomputed old log-probs are an independent reference for the engine's: after
every update the engine must generate with the new weights, or the gap grows (the negative control in
tests/rollout/test_vllm_rollout.py shows a skipped sync changes the tokens).
"""

from __future__ import annotations

import logging
import os
import re
import signal

import pytest

pytest.importorskip("vllm")

from tests.trainer.test_grpo_trainer import LETTER_REWARD, _grpo_config  # noqa: E402
from verl_balance.models.tiny_hf import write_tiny_model  # noqa: E402
from verl_balance.trainer.grpo.trainer import GRPOTrainer  # noqa: E402
from verl_balance.workers.actor_rollout import ActorRolloutWorker  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

DIFF = "training/rollout_probs_diff_max"
PROBS_DIFF_MAX = 1e-3
"""fp32 on CPU: vLLM's kernels vs the trainer's packed forward differ by ~1e-5 in a probability; a
stale engine (one step behind, lr 1e-2) is off by far more."""


def _run_grpo(overrides: list[str], *, trainer_cls=None) -> tuple[dict, list[dict]]:
    """main_grpo's trainer for these overrides (sync or async, as main_grpo picks it, unless
    ``trainer_cls``), fitted; its summary and metrics."""
    from verl_balance.trainer.grpo.async_trainer import grpo_trainer_class
    from verl_balance.utils.tracking import read_metrics

    cfg = _grpo_config(overrides)
    trainer = (trainer_cls or grpo_trainer_class(cfg))(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return summary, read_metrics(summary["metrics"])


def _run_on_vllm(root, extra: list[str], *, trainer_cls=None) -> tuple[dict, list[dict]]:
    (root / "letters.py").write_text(LETTER_REWARD)
    model = write_tiny_model(str(root / "qwen3"), family="qwen3", hidden_size=128)
    summary, records = _run_grpo(
        [
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=2",
            "trainer.logger=[jsonl]",
            "trainer.plot=false",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={root / 'run'}",
            "trainer.total_training_steps=3",
            "trainer.test_freq=-1",
            "trainer.val_before_train=false",
            "data.synthetic.num_train=64",
            "data.synthetic.num_val=4",
            f"data.synthetic.out_dir={root / 'data'}",
            "data.synthetic.tasks=[copy]",
            "data.synthetic.max_size=6",
            "data.max_prompt_length=32",
            "data.train_batch_size=4",
            f"actor_rollout_ref.model.path={model}",
            "actor_rollout_ref.rollout.name=vllm",
            # eager engines start in ~1 s; the compiled default (16 s per engine here) is proven against
            # HF across weight updates in tests/rollout/test_vllm_rollout.py
            "actor_rollout_ref.rollout.enforce_eager=true",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            f"custom_reward_function.path={root / 'letters.py'}",
            *extra,
        ],
        trainer_cls=trainer_cls,
    )
    return summary, [r for r in records if DIFF in r]


@pytest.fixture(scope="module")
def sync_steps(ray_cluster, tmp_path_factory):
    return _run_on_vllm(tmp_path_factory.mktemp("grpo_vllm_sync"), [])[1]


@pytest.fixture(scope="module")
def sp2_steps(ray_cluster, tmp_path_factory):
    """One Ulysses group of two ranks (dp1 x sp2): the trainer's old log-probs come from the sequence-
    sharded forward, the rollout from each rank's engine."""
    extra = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"]
    return _run_on_vllm(tmp_path_factory.mktemp("grpo_vllm_sp2"), extra)[1]


@pytest.fixture(scope="module")
def separate_async_lora_steps(ray_cluster, tmp_path_factory):
    """separate_async (one vLLM rollout worker on its own pool, weights sent bucket by bucket after each
    sync) with LoRA (the rollout worker merges the adapters); the trainer recomputes the old log-probs,
    which at step k use the weights batch k was generated with (version k - 1)."""
    extra = [
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "actor_rollout_ref.actor.recompute_old_log_prob=always",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
    ]
    return _run_on_vllm(tmp_path_factory.mktemp("grpo_vllm_async"), extra)[1]


def test_three_grpo_steps_on_vllm_at_dp2_keep_the_rollout_on_the_trainers_weights(sync_steps):
    assert [r["step"] for r in sync_steps] == [1, 2, 3]
    for r in sync_steps:
        assert r[DIFF] < PROBS_DIFF_MAX, r
    # the weights moved between steps (so steps 2 and 3 test a sync, not the initial load)
    assert all(r["actor/grad_norm"] > 0 for r in sync_steps)


def test_three_grpo_steps_on_vllm_at_sp2_keep_the_rollout_on_the_trainers_weights(sp2_steps):
    assert [r["step"] for r in sp2_steps] == [1, 2, 3]
    for r in sp2_steps:
        assert r[DIFF] < PROBS_DIFF_MAX, r
    assert all(r["actor/grad_norm"] > 0 for r in sp2_steps)


def test_separate_async_with_lora_on_a_vllm_rollout_worker(separate_async_lora_steps):
    """Batch 1 is generated with the initial weights (the base sent bucket by bucket to the rollout
    worker, the adapters merged there), which the trainer still holds at step 1: their gap is fp32
    noise. Later batches are one version stale by design (one-step off-policy), so their gap is that
    of an update (lr 1e-2): the metric sees a stale engine, which is the negative control; the sync
    after each step is what tests/rollout/test_vllm_rollout.py's token-exact test and the sync run
    above cover."""
    steps = separate_async_lora_steps
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[0][DIFF] < PROBS_DIFF_MAX, steps[0]
    assert all(r[DIFF] > PROBS_DIFF_MAX for r in steps[1:]), steps[1:]
    assert all(r["actor/grad_norm"] > 0 for r in steps)


def test_colocate_async_generates_on_the_actors_vllm_engines(ray_cluster, tmp_path):
    """colocate_async: the actor's own engines generate batch k + 1 before step k's update (one step
    off-policy), so as with separate_async only batch 1 is on the trainer's weights."""
    extra = ["trainer.v1.trainer_mode=colocate_async", "actor_rollout_ref.actor.recompute_old_log_prob=always"]
    steps = _run_on_vllm(tmp_path, extra)[1]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[0][DIFF] < PROBS_DIFF_MAX, steps[0]
    assert all(r[DIFF] > PROBS_DIFF_MAX for r in steps[1:]), steps[1:]


class EngineKilledOnceWorker(ActorRolloutWorker):
    """Rank 1 SIGKILLs its own process (the vLLM engine runs in it) after the engine's first scheduler
    step of its second generation (step 2's), once per run: it writes its pid to ``engine_killed``
    beside the model directory first, so the restarted worker generates normally."""

    generations = 0

    def _refresh_rollout_weights(self) -> None:
        super()._refresh_rollout_weights()
        self.generations += 1
        marker = os.path.join(os.path.dirname(self.config.model.path), "engine_killed")
        if self.rank != 1 or self.generations != 2 or os.path.exists(marker):
            return
        engine = self.rollout.llm.llm_engine
        step = engine.step

        def step_then_die():
            outputs = step()
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
            return outputs

        engine.step = step_then_die


class EngineKilledOnceTrainer(GRPOTrainer):
    worker_cls = EngineKilledOnceWorker


def test_an_engine_killed_mid_generation_is_named_and_the_run_goes_on_from_its_checkpoint(
    ray_cluster, tmp_path, caplog
):
    extra = ["trainer.max_restarts=1", "trainer.save_freq=1"]
    with caplog.at_level(logging.WARNING, logger="verl_balance.trainer.driver"):
        summary, steps = _run_on_vllm(tmp_path, extra, trainer_cls=EngineKilledOnceTrainer)
    pid = int((tmp_path / "engine_killed").read_text())
    deaths = [r.getMessage() for r in caplog.records if "a worker died" in r.getMessage()]
    assert len(deaths) == 1, deaths
    named = rf"worker rank 1 \(actor \w+, name [^)]*, pid {pid}\) died during \S*generate_sequences"
    assert re.search(named, deaths[0]), deaths[0]
    assert "restart 1 of trainer.max_restarts=1" in deaths[0]
    # the run went on from global_step_1: step 2 redone on new engines, whose sync keeps them exact
    assert summary["restarts"] == 1 and [r["step"] for r in steps] == [1, 2, 3]
    assert all(r[DIFF] < PROBS_DIFF_MAX for r in steps), steps
