"""The end-of-run summary a user reads (``DriverBase.format_summary`` with each recipe's title and
``summary_lines``), pinned as text: SFT's loss and eval loss, GRPO/PPO's reward and held-out metric,
and the common frame (steps and time, metrics file, plot only when there is one)."""

from __future__ import annotations

from verl_balance.trainer.grpo.trainer import GRPOTrainer
from verl_balance.trainer.grpo.trainer import format_summary as grpo_summary
from verl_balance.trainer.sft_trainer import SFTTrainer
from verl_balance.trainer.sft_trainer import format_summary as sft_summary

BASE = {"steps": 64, "wall_s": 123.456, "metrics": "/run/metrics.jsonl", "restarts": 0}


def test_sft_summary_names_the_loss_first_to_final_the_eval_loss_and_the_files():
    summary = {**BASE, "first_loss": 5.54971, "final_loss": 2.76761, "val/loss": 2.8, "plot": "/run/curves.png"}
    assert sft_summary(summary) == (
        "\n==== SFT summary ====\nsteps: 64 in 123.5 s\ntrain loss: first 5.5497 -> final 2.7676\n"
        "eval loss: 2.8000\nmetrics: /run/metrics.jsonl\nplot: /run/curves.png"
    )
    assert sft_summary({**BASE, "first_loss": None, "final_loss": None, "plot": None}) == (
        "\n==== SFT summary ====\nsteps: 64 in 123.5 s\nmetrics: /run/metrics.jsonl"
    )


def test_an_interrupted_summary_says_so_and_labels_the_eval_loss_with_its_step():
    summary = {**BASE, "first_loss": 5.5, "final_loss": 3.0, "val/loss": 2.8, "val_step": 50, "plot": None}
    stopped = {**summary, "steps": 73, "total_steps": 100, "stop_signal": "SIGINT"}
    assert sft_summary(stopped) == (
        "\n==== SFT summary ====\n"
        "interrupted (SIGINT) after step 73 of 100: checkpoint saved, the same command resumes\n"
        "steps: 73 in 123.5 s\ntrain loss: first 5.5000 -> final 3.0000\n"
        "eval loss (step 50): 2.8000\nmetrics: /run/metrics.jsonl"
    )
    assert "interrupted" not in sft_summary({**summary, "stop_signal": None})  # negative control: it finished


def test_grpo_summary_names_the_reward_and_held_out_metric_before_and_after():
    summary = {
        **BASE,
        "first_reward": 0.1,
        "final_reward": 0.9,
        "val_key": "val/acc",
        "initial_val": None,
        "final_val": 0.75,
        "plot": "/run/curves.png",
    }
    assert grpo_summary(summary) == (
        "\n==== GRPO summary ====\nsteps: 64 in 123.5 s\n"
        "train score (critic/score/mean): first 0.1000 -> final 0.9000\n"
        "held-out accuracy (val/acc): before n/a -> after 0.7500\nmetrics: /run/metrics.jsonl\nplot: /run/curves.png"
    )
    # a reward without ``acc``: the held-out line names the mean reward; a critic run is titled PPO
    ppo = {**summary, "algorithm": "PPO", "val_key": "val/reward_mean", "initial_val": 0.25, "plot": None}
    assert grpo_summary(ppo) == (
        "\n==== PPO summary ====\nsteps: 64 in 123.5 s\ntrain score (critic/score/mean): first 0.1000 -> final 0.9000\n"
        "held-out mean reward (val/reward_mean): before 0.2500 -> after 0.7500\nmetrics: /run/metrics.jsonl"
    )
    empty = {**BASE, "first_reward": None, "val_key": "val/reward_mean", "initial_val": None, "final_val": None}
    assert grpo_summary(empty) == "\n==== GRPO summary ====\nsteps: 64 in 123.5 s\nmetrics: /run/metrics.jsonl"


def test_each_recipe_shares_the_drivers_frame():
    assert sft_summary == SFTTrainer.format_summary and grpo_summary == GRPOTrainer.format_summary
    assert "format_summary" not in vars(SFTTrainer) and "format_summary" not in vars(GRPOTrainer)
