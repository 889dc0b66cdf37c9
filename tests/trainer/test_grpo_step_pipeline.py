"""The GRPO step's shared pieces (trainer/grpo/): the one rollout-batch builder, the critic's role
object and the old-log-prob decision, checked against hand-worked examples; and a source check that
the sync and async trainers share them instead of re-assembling columns or branching on the critic."""

from __future__ import annotations

import pathlib
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from verl_balance.batch_keys import (
    ATTENTION_MASK_KEY,
    FINISH_REASON_KEY,
    INDEX_KEY,
    PROMPT_IDS_KEY,
    PROMPT_INDEX_KEY,
    PROMPT_LENGTHS_KEY,
    RESPONSE_LENGTHS_KEY,
    RETURNS_KEY,
    SAMPLE_INDEX_KEY,
    UID_KEY,
    VALUES_KEY,
)
from verl_balance.protocol import Batch
from verl_balance.rollout import RolloutOutput
from verl_balance.trainer.grpo import critic_role
from verl_balance.trainer.grpo.critic_role import NO_CRITIC, ActorCriticCheckpoint, CriticRole
from verl_balance.trainer.grpo.old_log_probs import OldLogProbs
from verl_balance.trainer.grpo.rollout_batch import mini_batch_rows, prompt_batch, rollout_batch

GRPO_DIR = pathlib.Path(__file__).resolve().parents[2] / "verl_balance" / "trainer" / "grpo"


def _prompts() -> tuple[dict, dict]:
    """Two prompts of lengths 3 and 2 (left-padded to 3), dataset indices 7 and 4."""
    tensors = {ATTENTION_MASK_KEY: torch.tensor([[1, 1, 1], [0, 1, 1]])}
    non_tensors = {
        PROMPT_IDS_KEY: np.array([[5, 6, 7], [8, 9]], dtype=object),
        INDEX_KEY: [7, 4],
        "data_source": np.array(["a", "b"], dtype=object),
        "ground_truth": np.array(["1", "2"], dtype=object),
        "extra_info": np.array([{"k": 0}, {"k": 1}], dtype=object),
    }
    return tensors, non_tensors


def test_prompt_batch_holds_each_prompts_ids_length_and_dataset_index():
    rows = prompt_batch(_prompts())
    assert rows[PROMPT_LENGTHS_KEY].tolist() == [3, 2]
    assert rows[SAMPLE_INDEX_KEY].tolist() == [7, 4] and rows[SAMPLE_INDEX_KEY].dtype == np.int64
    assert [list(p) for p in rows[PROMPT_IDS_KEY]] == [[5, 6, 7], [8, 9]]


def test_rollout_batch_repeats_each_prompts_columns_on_its_responses():
    """Three responses: two to prompt 0, one to prompt 1 (prompt-major); each row carries its own
    prompt's uid (dataset index) and reward columns, and its response right after its prompt."""
    output = RolloutOutput(
        prompt_index=np.array([0, 0, 1]),
        responses=torch.tensor([[11, 12], [13, 0], [14, 15]]),
        response_mask=torch.tensor([[1, 1], [1, 0], [1, 1]]),
        response_lengths=torch.tensor([2, 1, 2]),
        finish_reasons=np.array(["length", "stop", "length"], dtype=object),
    )
    batch = rollout_batch(_prompts(), output, pad_token_id=0)
    assert batch[PROMPT_INDEX_KEY].tolist() == [0, 0, 1]
    assert batch[UID_KEY].tolist() == [7, 7, 4]
    assert batch["data_source"].tolist() == ["a", "a", "b"]
    assert batch["ground_truth"].tolist() == ["1", "1", "2"]
    assert [e["k"] for e in batch["extra_info"]] == [0, 0, 1]
    assert batch[FINISH_REASON_KEY].tolist() == ["length", "stop", "length"]
    assert batch[PROMPT_LENGTHS_KEY].tolist() == [3, 3, 2] and batch[RESPONSE_LENGTHS_KEY].tolist() == [2, 1, 2]
    ids = batch["input_ids"].tolist()
    assert ids[1][:4] == [5, 6, 7, 13] and ids[2][:4] == [8, 9, 14, 15]


def test_mini_batches_take_consecutive_prompts_with_all_their_responses():
    batch = Batch.from_dict(tensors={}, non_tensors={PROMPT_INDEX_KEY: np.array([0, 0, 1, 1, 2, 2, 3])})
    rows = mini_batch_rows(batch, size=3)
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3, 4, 5], [6]]


def _config(*, from_update: bool, bypass: bool, recompute: str = "auto") -> SimpleNamespace:
    return SimpleNamespace(
        old_log_prob_from_update=from_update,
        algorithm=SimpleNamespace(rollout_correction=SimpleNamespace(bypass_mode=bypass)),
        actor_rollout_ref=SimpleNamespace(actor=SimpleNamespace(recompute_old_log_prob=recompute)),
    )


@pytest.mark.parametrize(
    "from_update, bypass, expected",
    [
        (True, False, OldLogProbs(recompute=False, from_update=True)),  # one on-policy update: its own forward
        (False, False, OldLogProbs(recompute=True, from_update=False)),  # the actor's pass
        (False, True, OldLogProbs(recompute=False, from_update=False)),  # bypass_mode: the rollout's
    ],
)
def test_sync_old_log_probs_come_from_the_update_the_pass_or_the_rollout(from_update, bypass, expected):
    assert OldLogProbs.sync(_config(from_update=from_update, bypass=bypass)) == expected


@pytest.mark.parametrize(
    "recompute, bypass, runs_pass",
    [("always", False, True), ("auto", False, False), ("never", False, False), ("always", True, False)],
)
def test_async_updates_are_never_on_policy_and_recompute_only_when_always(recompute, bypass, runs_pass):
    config = _config(from_update=True, bypass=bypass, recompute=recompute)  # the sync rule would say "update"
    assert OldLogProbs.off_policy(config) == OldLogProbs(recompute=runs_pass, from_update=False)


class _FakeCriticGroup:
    """A critic group: ``compute_values.submit`` and ``update_critic`` record what they got."""

    def __init__(self):
        self.updates: list[list[int]] = []
        self.submitted = []
        self.compute_values = SimpleNamespace(submit=lambda chunks: self.submitted.append(chunks) or "future")

    def update_critic(self, chunks):
        self.updates.append(chunks[0]["input_ids"][:, 0].tolist())  # the rows' prompt indices
        return [{"vf_loss": float(len(self.updates)), "dp_rank": 0, "busy_seconds": 1.0}]


def _critic(monkeypatch, **overrides) -> CriticRole:
    monkeypatch.setattr(critic_role, "split_by_plan", lambda batch, plan: [batch])
    keys = dict(ppo_epochs=2, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=1, use_dynamic_bsz=False)
    config = SimpleNamespace(**{**keys, **overrides}, ppo_max_token_len_per_gpu=None, model=SimpleNamespace(path="x"))
    return CriticRole(config=config, start=_FakeCriticGroup, plan=lambda batch, **kwargs: "plan")


def _critic_batch() -> Batch:
    """Three prompts, two responses each (input_ids: the row's prompt index); values 0, returns 1."""
    mask = torch.ones(6, 2)
    prompt_index = np.array([0, 0, 1, 1, 2, 2])
    ids = torch.as_tensor(prompt_index)[:, None].repeat(1, 2)
    sequences = {"input_ids": ids, ATTENTION_MASK_KEY: mask.long(), "position_ids": torch.tensor([[0, 1]] * 6)}
    return Batch.from_dict(
        tensors={**sequences, "loss_mask": mask, VALUES_KEY: 0 * mask, RETURNS_KEY: mask.clone()},
        non_tensors={PROMPT_INDEX_KEY: prompt_index},
    )


def test_critic_role_trains_epochs_times_mini_batches_and_logs_their_mean(monkeypatch):
    """2 epochs x mini-batches of 2 prompts over 3 prompts: 4 value-loss steps on prompts {0,1} and
    {2} in turn; the logged vf_loss is the mean of the steps' (1 + 2 + 3 + 4) / 4."""
    critic, metrics, phases = _critic(monkeypatch), {}, []
    critic.train(_critic_batch(), metrics=metrics, phase=phases.append)
    assert critic.group.updates == [[0, 0, 1, 1], [2, 2], [0, 0, 1, 1], [2, 2]]
    assert metrics["critic/num_optimizer_steps"] == 4.0
    assert metrics["critic/vf_loss"] == pytest.approx(2.5)
    assert metrics["critic/returns/mean"] == 1.0 and metrics["critic/values/mean"] == 0.0
    assert phases == ["critic update"] and "timing_s/update_critic" in metrics
    one_epoch = _critic(monkeypatch, ppo_epochs=1)  # negative control: the epochs count
    one_epoch.train(_critic_batch(), metrics={}, phase=phases.append)
    assert len(one_epoch.group.updates) == 2


def test_no_critic_leaves_the_step_as_grpo_and_the_critic_role_adds_its_parts(monkeypatch):
    full, pending, metrics = _critic_batch(), {}, {}
    batch = full.select(batch_keys=[k for k in full.tensor_keys if k != RETURNS_KEY])
    returns = torch.full((6, 2), 3.0)
    NO_CRITIC.submit_values(batch, pending=pending, metrics=metrics)
    NO_CRITIC.attach_returns(batch, returns)
    NO_CRITIC.train(batch, metrics=metrics, phase=lambda name: None)
    actor = object()
    assert pending == {} and metrics == {} and RETURNS_KEY not in batch
    assert NO_CRITIC.checkpoint_group(actor) is actor and NO_CRITIC.algorithm == "GRPO"
    critic = _critic(monkeypatch)
    critic.submit_values(batch, pending=pending, metrics=metrics)
    critic.attach_returns(batch, returns)
    assert pending == {VALUES_KEY: ("plan", "future")} and "timing_s/values" in metrics
    assert torch.equal(batch[RETURNS_KEY], returns)
    group = critic.checkpoint_group(actor)
    assert isinstance(group, ActorCriticCheckpoint) and group.actor is actor and group.critic is critic.group


def test_sync_and_async_trainers_share_the_step_pieces():
    """No module of trainer/grpo/ assembles rollout columns but rollout_batch.py, branches on a
    missing critic, or keeps the old-log-prob decision as trainer state."""
    sources = {path.name: path.read_text() for path in GRPO_DIR.glob("*.py")}
    assert {"trainer.py", "async_trainer.py"} <= set(sources)  # negative control: the scan sees both trainers
    builders = sorted(name for name, text in sources.items() if "build_rollout_batch(" in text)
    assert builders == ["rollout_batch.py"]
    for name, text in sources.items():
        assert not re.search(r"critic is (not )?None", text), name
        assert not re.search(r"self\.(old_log_prob_from_update|_recompute_old)\s*=", text), name
