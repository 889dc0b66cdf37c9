"""main_grpo with LoRA (actor_rollout_ref.model.lora_rank > 0) on a tiny HF model, end to end: two
steps with the KL loss (reference = base model, adapters disabled), the adapters train, and the
rollout's log-probs (merged weights) match the trainer's old log-probs as closely as a run
without LoRA does.

Reference: the same GRPO run with lora_rank=0 (its rollout-vs-trainer gap is the bar).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.trainer.conftest import compose_config
from verl_balance.utils.tracking import read_metrics

pytestmark = pytest.mark.slow


def _grpo(model_dir: str, root, extra: list[str]) -> list[dict]:
    from verl_balance.trainer.grpo_config import register_grpo_schema
    from verl_balance.trainer.grpo_trainer import GRPOTrainer

    register_grpo_schema()
    cfg = compose_config(
        "grpo",
        [
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=2",
            "trainer.logger=[jsonl]",
            "trainer.plot=false",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={root / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "data.synthetic.num_train=64",
            "data.synthetic.num_val=4",
            f"data.synthetic.out_dir={root / 'data'}",
            "data.synthetic.tasks=[copy]",
            "data.synthetic.max_size=6",
            "data.max_prompt_length=64",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=5e-2",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.response_length=8",
            "actor_rollout_ref.actor.use_kl_loss=true",
            # A random tiny model earns no reward (zero advantages): the entropy bonus makes the
            # adapters move anyway, so the KL to the base model is exercised.
            "actor_rollout_ref.actor.entropy_coeff=0.1",
            "trainer.total_training_steps=2",
            "trainer.test_freq=-1",
            *extra,
        ],
    )
    trainer = GRPOTrainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return [r for r in read_metrics(summary["metrics"]) if "reward/mean" in r]


@pytest.fixture(scope="module")
def grpo_runs(ray_cluster, tiny_qwen2, tmp_path_factory):
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
    return {
        "lora": _grpo(tiny_qwen2, tmp_path_factory.mktemp("grpo_lora"), lora),
        "full": _grpo(tiny_qwen2, tmp_path_factory.mktemp("grpo_full"), []),
    }


def test_grpo_with_lora_runs_two_steps_with_the_kl_loss(grpo_runs):
    train = grpo_runs["lora"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        for key in ("actor/pg_loss", "actor/kl", "actor/grad_norm", "response_length/mean"):
            assert np.isfinite(r[key]), key
        assert r["actor/grad_norm"] > 0
    # After updates of the adapters the actor has moved away from the reference (the base model):
    # a reference that followed the actor would give KL 0.
    assert train[1]["actor/kl"] > 1e-7


def test_lora_rollout_log_probs_match_the_trainer_as_closely_as_full_fine_tuning(grpo_runs):
    for name in ("lora", "full"):
        assert all("rollout/probs_diff_max" in r for r in grpo_runs[name]), name
    lora = max(r["rollout/probs_diff_max"] for r in grpo_runs["lora"])
    full = max(r["rollout/probs_diff_max"] for r in grpo_runs["full"])
    print(f"rollout/probs_diff_max: lora {lora:.3e}, full {full:.3e}")
    # fp32 on CPU: both gaps are last-bit differences between two forwards (merged vs unmerged).
    assert lora < max(10 * full, 1e-5), (lora, full)
