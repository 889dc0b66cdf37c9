"""``balance/imbalance_measured`` has one meaning in both recipes: max / mean over ranks of the
per-rank busy seconds (compute without collective waits, engine/timing.py).

Hand-worked example: per-rank engine metrics in which every rank's wall time is the same (the
faster ranks wait in FSDP's collectives for the slowest) but the busy time differs. A rank that
only waited has busy time 0 and must not count as busy. Negative control: the wall-time figure
(what GRPO logged before, ``compute_seconds``) would report perfect balance (1.0) here.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl_balance.batch_keys import PROMPT_INDEX_KEY
from verl_balance.protocol import Batch
from verl_balance.trainer.grpo import trainer as grpo_trainer
from verl_balance.trainer.grpo.trainer import GRPOTrainer
from verl_balance.trainer.metrics import busy_seconds, measured_balance_metrics, reduce_rank_metrics

WALL = 4.0  # every rank's wall seconds of an update: they all wait for the slowest


def _rank(*, dp_rank: int, busy: float) -> dict:
    """One rank's ``TrainEngine.train_step`` timing (two micro-batches) plus global figures."""
    return {
        "loss": 1.5,
        "grad_norm": 0.5,
        "dp_rank": dp_rank,
        "busy_seconds": busy,
        "micro_batch_busy_seconds": [busy / 2, busy / 2],
        "micro_batch_seconds": [WALL / 2, WALL / 2],
    }


# Busy seconds per (update, DP rank): rank 1 only waits in the first update.
BUSY = [[3.0, 0.0], [1.0, 2.0]]


def _wall_time_imbalance(updates: list[list[dict]]) -> float:
    """The known-bad figure: max / mean of the per-rank wall seconds summed over the updates."""
    wall = np.sum([[sum(m["micro_batch_seconds"]) for m in per_rank] for per_rank in updates], axis=0)
    return float(wall.max() / wall.mean())


def test_a_rank_that_only_waits_is_not_busy_in_the_sft_reduction():
    per_rank = [_rank(dp_rank=d, busy=b) for d, b in enumerate(BUSY[0])]
    out = reduce_rank_metrics(per_rank, prefix="train/")
    assert busy_seconds(per_rank).tolist() == [3.0, 0.0]
    assert out["balance/imbalance_measured"] == pytest.approx(3.0 / 1.5)
    assert (out["timing_s/busy_max"], out["timing_s/busy_mean"]) == (3.0, 1.5)
    assert _wall_time_imbalance([per_rank]) == 1.0  # negative control: wall time hides it


def test_measured_balance_is_empty_when_no_rank_was_busy():
    assert measured_balance_metrics(np.zeros(2)) == {}
    assert measured_balance_metrics(np.zeros(0)) == {}


class _FakeActor:
    """``update_actor`` of a 2-rank actor group returning the per-rank metrics of BUSY in turn."""

    def __init__(self):
        self.calls = 0

    def update_actor(self, chunks):
        per_rank = [_rank(dp_rank=d, busy=b) for d, b in enumerate(BUSY[self.calls])]
        self.calls += 1
        return per_rank


def test_grpo_update_measures_imbalance_from_busy_time_summed_over_its_updates(monkeypatch):
    """GRPOTrainer.train_actor over two mini-batches (one update each): busy sums [4, 2] over
    the two ranks give 4 / 3, as the SFT definition applied to the step's summed busy time."""
    monkeypatch.setattr(grpo_trainer, "split_by_plan", lambda mini, plan: [mini])
    monkeypatch.setattr(grpo_trainer, "plan_metrics", lambda plan: {})
    actor = _FakeActor()
    trainer = SimpleNamespace(
        actor_cfg=SimpleNamespace(
            ppo_epochs=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=None, use_kl_loss=False
        ),
        dp=2,
        update_cap=None,
        actor=actor,
        _plan=lambda mini, **kwargs: None,
    )
    trainer._mini_batches = lambda batch: GRPOTrainer._mini_batches(trainer, batch)
    batch = Batch.from_dict({PROMPT_INDEX_KEY: torch.tensor([0, 0, 1, 1])})
    out = GRPOTrainer.train_actor(trainer, batch, on_policy=False)
    assert actor.calls == 2
    summed = np.sum(BUSY, axis=0)
    assert out["balance/imbalance_measured"] == pytest.approx(summed.max() / summed.mean()) == pytest.approx(4 / 3)
    assert out == {**out, **measured_balance_metrics(summed)}
    updates = [[_rank(dp_rank=d, busy=b) for d, b in enumerate(row)] for row in BUSY]
    assert _wall_time_imbalance(updates) == 1.0  # negative control: the wall-time figure
