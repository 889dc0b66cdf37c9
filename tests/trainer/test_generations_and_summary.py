"""Generations on disk as verl writes them (trainer.rollout_data_dir / validation_data_dir), honest
held-out metric names and summary titles, and a resumed run's summary read from metrics.jsonl."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

from tests.trainer.conftest import compose_config
from verl_balance.trainer.grpo.trainer import format_summary
from verl_balance.trainer.metrics import validation_metrics
from verl_balance.trainer.summary import recorded_ends

PARTIAL_CREDIT_REWARD = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        """Partial credit, no ``acc``: the fraction of lowercase ASCII letters."""
        return sum("a" <= c <= "z" for c in solution_str) / max(len(solution_str), 1)
''')


def test_held_out_metrics_name_acc_only_when_the_reward_returns_it():
    scores = np.array([1.0, 0.5, 0.0, 0.5])
    sources = np.array(["a", "a", "b", "b"])
    common = {"sources": sources, "uids": np.array([0, 1, 2, 3]), "response_lengths": np.array([1, 2, 3, 4])}
    partial = validation_metrics(scores=scores, extras={}, **common)
    assert partial == {
        "val/reward_mean": 0.5,
        "val-core/a/reward/mean@1": 0.75,
        "val-core/b/reward/mean@1": 0.25,
        "val/response_length/mean": 2.5,
        "val/response_length/max": 4.0,
        "val/response_length/min": 1.0,
    }
    with_acc = validation_metrics(scores=scores, extras={"acc": np.array([1.0, 0.0, 0.0, 0.0])}, **common)
    assert (
        with_acc["val/acc"] == 0.25 and with_acc["val-core/a/acc/mean@1"] == 0.5 and with_acc["val/reward_mean"] == 0.5
    )
    assert with_acc["val-aux/a/reward/mean@1"] == 0.75 and "val-core/a/reward/mean@1" not in with_acc


def test_summary_is_titled_by_algorithm_and_names_the_held_out_metric():
    base = {"steps": 3, "wall_s": 1.0, "startup_s": 2.0, "metrics": "m.jsonl", "first_reward": 0.1}
    base["final_reward"] = 0.2
    ppo = format_summary({**base, "algorithm": "PPO", "val_key": "val/acc", "initial_val": 0.3, "final_val": 0.7})
    assert "==== PPO summary ====" in ppo and "held-out accuracy (val/acc): before 0.3000 -> after 0.7000" in ppo
    grpo = format_summary({**base, "algorithm": "GRPO", "val_key": "val/reward_mean", "final_val": 0.4})
    assert "==== GRPO summary ====" in grpo and "held-out mean reward (val/reward_mean)" in grpo
    assert "accuracy" not in grpo, "a partial-credit reward is not called accuracy"


def test_resumed_summary_reads_the_first_and_last_values_from_the_metrics_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [
        {"step": 0, "val/acc": 0.25},
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.2, "val/acc": 0.5},
        {"step": 3, "reward/mean": 0.3},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ends = recorded_ends(str(path))
    assert ends["first"]["step"] == 1 and ends["first"]["reward/mean"] == 0.1
    assert ends["first_val"] == {"step": 0, "val/acc": 0.25}
    assert ends["last"] == {"step": 3, "reward/mean": 0.3}
    assert ends["last_val"]["val/acc"] == 0.5 and ends["last_val_step"] == 2
    missing = recorded_ends(str(tmp_path / "missing.jsonl"))
    assert missing == {"first": {}, "last": {}, "first_val": {}, "last_val": {}, "last_val_step": None}


@pytest.mark.slow
def test_grpo_writes_generations_in_verls_layout(ray_cluster, tmp_path):
    from verl_balance.trainer.config.grpo import register_grpo_schema
    from verl_balance.trainer.grpo.trainer import GRPOTrainer
    from verl_balance.utils.tracking import read_metrics

    register_grpo_schema()
    reward_file = tmp_path / "partial.py"
    reward_file.write_text(PARTIAL_CREDIT_REWARD)
    rollout_dir, val_dir = tmp_path / "rollouts", tmp_path / "val_generations"
    cfg = compose_config(
        "grpo",
        [
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=1",
            "trainer.logger=[file]",
            "trainer.plot=false",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            f"trainer.rollout_data_dir={rollout_dir}",
            f"trainer.validation_data_dir={val_dir}",
            "data.synthetic.num_train=16",
            "data.synthetic.num_val=4",
            f"data.synthetic.out_dir={tmp_path / 'data'}",
            "data.synthetic.tasks=[copy]",
            "data.synthetic.max_size=4",
            "data.max_prompt_length=32",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.rollout.response_length=6",
            f"custom_reward_function.path={reward_file}",
        ],
    )
    trainer = GRPOTrainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    records = {r["step"]: r for r in read_metrics(summary["metrics"])}
    assert sorted(p.name for p in rollout_dir.iterdir()) == ["1.jsonl", "2.jsonl"]
    assert sorted(p.name for p in val_dir.iterdir()) == ["0.jsonl", "2.jsonl"]
    for step in (1, 2):
        rows = [json.loads(line) for line in (rollout_dir / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 4 * 2, "one line per response: 4 prompts x n=2"
        assert all(set(r) >= {"input", "output", "gts", "score", "step"} and r["step"] == step for r in rows)
        assert np.mean([r["score"] for r in rows]) == pytest.approx(
            records[step]["critic/score/mean"], rel=1e-6
        )  # float32 scores
    val_rows = [json.loads(line) for line in (val_dir / "2.jsonl").read_text().splitlines()]
    assert np.mean([r["score"] for r in val_rows]) == pytest.approx(records[2]["val/reward_mean"], rel=1e-6)
    assert "val/acc" not in records[2], "the reward returns no acc: no accuracy is claimed"
    assert summary["algorithm"] == "GRPO" and summary["val_key"] == "val/reward_mean"


def test_model_load_line_announces_lora_with_trainable_and_total_parameters():
    from verl_balance.trainer.driver import describe_parameters

    full = [{"parameters": 1_234_567, "trainable_parameters": 1_234_567}]
    lora = [{"parameters": 494_032_768, "trainable_parameters": 1_081_344}]
    assert describe_parameters(full) == "1.23M parameters"
    assert describe_parameters(lora) == "LoRA: 1.08M trainable of 494M parameters (0.22%)"
    assert describe_parameters(None) == ""


@pytest.mark.slow
def test_a_resumed_sft_summary_starts_from_the_runs_first_step(sft_reference_runs):
    from verl_balance.trainer.sft_trainer import format_summary

    (stopped, first), (summary, _) = sft_reference_runs["first"], sft_reference_runs["resumed"]
    assert [r["step"] for r in first] == [1, 2, 3]
    # The run Ctrl-C stopped says so; the one that finished does not.
    assert "interrupted (SIGINT) after step 3 of 4: checkpoint saved, the same command resumes" in format_summary(
        stopped
    )
    assert "interrupted" not in format_summary(summary)
    assert summary["resumed_from_step"] == 3 and summary["steps"] == 4
    assert summary["first_loss"] == first[0]["train/loss"], "the run's step 1, not the resumed part's step 4"
    assert "resumed at step 3" in format_summary(summary)


def test_decode_generations_splits_prompt_and_response_and_honours_the_limit():
    import torch

    from verl_balance.data.tokenizer import build_tokenizer
    from verl_balance.trainer.grpo.generations import decode_generations

    tokenizer = build_tokenizer(None)
    rows = [("copy ab", "ab"), ("copy xyz", "xyz!")]
    encoded = [(tokenizer.encode(p), tokenizer.encode(r)) for p, r in rows]
    width = max(len(p) + len(r) for p, r in encoded) + 2
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (p, r) in enumerate(encoded):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
    batch = {
        "input_ids": ids,
        "prompt_lengths": torch.tensor([len(p) for p, _ in encoded]),
        "response_lengths": torch.tensor([len(r) for _, r in encoded]),
    }
    assert decode_generations(batch, tokenizer) == (["copy ab", "copy xyz"], ["ab", "xyz!"])
    assert decode_generations(batch, tokenizer, limit=1) == (["copy ab"], ["ab"])
