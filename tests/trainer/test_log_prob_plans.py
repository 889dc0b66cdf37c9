"""verl's separate micro-batching of the log-prob passes: ``rollout.log_prob_*`` cuts the old log-prob
pass and ``ref.log_prob_*`` the reference pass (null ref keys take the old pass's, then the actor's).
Log-probs are per token, so every plan gives the same values in row order: the trainer's dispatch is
run with two different plans and compared with one whole-batch computation (rtol 1e-6)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config
from verl_balance.balance import TokenWorkload
from verl_balance.batch_keys import (
    ATTENTION_MASK_KEY,
    INPUT_IDS_KEY,
    LOG_PROBS_KEY,
    MICRO_BATCH_SIZES_KEY,
    OLD_LOG_PROBS_KEY,
    POSITION_IDS_KEY,
    PROMPT_INDEX_KEY,
    REF_LOG_PROB_KEY,
)
from verl_balance.protocol import Batch
from verl_balance.trainer.config.checks import ConfigError
from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo
from verl_balance.trainer.grpo.old_log_probs import OldLogProbs
from verl_balance.trainer.grpo.trainer import GRPOTrainer
from verl_balance.trainer.plan_dispatch import merge_by_plan

register_grpo_schema()
AR = "actor_rollout_ref"


def _config(tmp_path, *overrides):
    return validate_grpo(compose_config("grpo", [*overrides, f"trainer.default_local_dir={tmp_path}"]))


def test_each_pass_takes_its_own_keys_then_the_old_pass_then_the_actor(tmp_path):
    cfg = _config(
        tmp_path,
        f"{AR}.actor.ppo_micro_batch_size_per_gpu=8",
        f"{AR}.rollout.log_prob_micro_batch_size_per_gpu=3",
        f"{AR}.ref.log_prob_use_dynamic_bsz=true",
        f"{AR}.ref.log_prob_max_token_len_per_gpu=500",
    )
    arr = cfg.actor_rollout_ref
    old, ref = arr.log_prob_plan("old"), arr.log_prob_plan("ref")
    assert (old.micro_batch_size, old.token_cap) == (3, None)  # fixed: the actor is not dynamic
    assert (ref.micro_batch_size, ref.token_cap, ref.token_cap_key) == (
        3,
        500,
        f"{AR}.ref.log_prob_max_token_len_per_gpu",
    )
    plain = _config(tmp_path).actor_rollout_ref  # nothing set: the actor's micro-batching for both
    assert plain.log_prob_plan("old") == plain.log_prob_plan("ref")
    assert plain.log_prob_plan("old").micro_batch_size == plain.actor.ppo_micro_batch_size_per_gpu


def test_a_log_prob_cap_below_one_sequence_is_refused_naming_its_key(tmp_path):
    with pytest.raises(ConfigError, match=rf"{AR}\.ref\.log_prob_max_token_len_per_gpu=8"):
        _config(tmp_path, f"{AR}.ref.log_prob_use_dynamic_bsz=true", f"{AR}.ref.log_prob_max_token_len_per_gpu=8")


def _per_token(input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A per-token stand-in for the model's log-probs: depends only on the row's own tokens."""
    ids = input_ids.double() * mask
    return -(torch.cumsum(ids, dim=1) / 1000.0 + 0.01 * ids) * mask


class _Pass:
    """A worker group method run in this process: each DP chunk, micro-batch by micro-batch."""

    def __init__(self, key: str) -> None:
        self.key, self.micro_batches = key, []

    def submit(self, chunks):
        outs = []
        for chunk in chunks:
            parts = chunk.split(list(chunk.meta[MICRO_BATCH_SIZES_KEY]))
            self.micro_batches += [(len(p), int(p[ATTENTION_MASK_KEY].sum())) for p in parts]
            values = [_per_token(p[INPUT_IDS_KEY], p[ATTENTION_MASK_KEY]) for p in parts]
            outs.append(Batch.from_dict(tensors={self.key: torch.cat(values)}))
        return SimpleNamespace(get=lambda: outs)


def _rollout_batch(rows: int = 24, width: int = 40, seed: int = 0) -> Batch:
    gen = np.random.default_rng(seed)
    lengths = gen.integers(4, width + 1, size=rows)
    mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], dtype=torch.long)
    ids = torch.tensor(gen.integers(1, 500, size=(rows, width))) * mask
    return Batch.from_dict(
        tensors={INPUT_IDS_KEY: ids, ATTENTION_MASK_KEY: mask, POSITION_IDS_KEY: torch.cumsum(mask, 1) - 1},
        non_tensors={PROMPT_INDEX_KEY: np.arange(rows) // 4},
    )


RECOMPUTE = OldLogProbs(recompute=True, from_update=False)
"""The step decision under test: the old-log-prob pass runs."""


def _trainer(cfg) -> GRPOTrainer:
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    arr = cfg.actor_rollout_ref
    trainer.config, trainer.actor_cfg, trainer.dp, trainer.sp = cfg, arr.actor, 2, 1
    trainer.workload = TokenWorkload()
    trainer.log_prob_plans = {"old_log_prob": arr.log_prob_plan("old"), "ref": arr.log_prob_plan("ref")}
    trainer.actor = SimpleNamespace(compute_log_prob=_Pass(LOG_PROBS_KEY), compute_ref_log_prob=_Pass(REF_LOG_PROB_KEY))
    return trainer


def test_old_and_ref_passes_run_their_own_plans_and_give_the_same_log_probs(tmp_path):
    cfg = _config(
        tmp_path,
        f"{AR}.actor.use_kl_loss=true",
        f"{AR}.rollout.log_prob_micro_batch_size_per_gpu=1",
        f"{AR}.ref.log_prob_use_dynamic_bsz=true",
        f"{AR}.ref.log_prob_max_token_len_per_gpu=200",
    )
    trainer, batch = _trainer(cfg), _rollout_batch()
    reference = _per_token(batch[INPUT_IDS_KEY], batch[ATTENTION_MASK_KEY])  # the whole batch at once
    pending = trainer._submit_log_prob_passes(batch, {}, old_log_probs=RECOMPUTE)
    trainer._collect_log_prob_passes(batch, pending, {})
    old_mbs, ref_mbs = trainer.actor.compute_log_prob.micro_batches, trainer.actor.compute_ref_log_prob.micro_batches
    assert {rows for rows, _ in old_mbs} == {1}  # rollout.log_prob_micro_batch_size_per_gpu=1
    assert max(rows for rows, _ in ref_mbs) > 1 and all(tokens <= 200 for _, tokens in ref_mbs)  # ref's cap
    torch.testing.assert_close(batch[OLD_LOG_PROBS_KEY].double(), reference, rtol=1e-6, atol=0)
    torch.testing.assert_close(batch[REF_LOG_PROB_KEY].double(), reference, rtol=1e-6, atol=0)
    # Negative control: the reference outputs merged by the old pass's plan are not in row order.
    (old_plan, _), (_, ref_future) = pending["old_log_prob"], pending["ref"]
    wrong = merge_by_plan(ref_future.get(), old_plan)[REF_LOG_PROB_KEY].double()
    assert not torch.allclose(wrong, reference, rtol=1e-6, atol=0)
