"""ActorWorker through Ray worker groups against the single-process reference of the parity
harness: the engine's layout invariance must survive planning, dispatch and collection.

Reference: verl_balance.parity.reference_steps (plain per-sequence forward, formulas written
out, torch AdamW) and a per-sequence forward for the log-probs; no distributed code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_balance.balance import plan_balance
from verl_balance.parity import ParitySettings, make_global_batch, reference_log_probs, reference_steps
from verl_balance.protocol import Batch
from verl_balance.trainer.plan_dispatch import merge_by_plan, split_by_plan
from verl_balance.workers.actor import ActorWorker, ActorWorkerConfig

pytestmark = pytest.mark.slow

SETTINGS = ParitySettings()
AGG_MODE = "token-mean"


def _group(sp: int):
    from verl_balance.single_controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    config = ActorWorkerConfig(model=SETTINGS.model, engine=SETTINGS.engine_config(agg_mode=AGG_MODE), sp_size=sp)
    pool = RayResourcePool(n_gpus_per_node=4, use_gpu=False)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(ActorWorker, config))
    group.init_model()
    return group


def _close(group) -> None:
    group.shutdown()
    group.resource_pool.remove()


@pytest.fixture(scope="module")
def reference():
    batch = make_global_batch(SETTINGS)
    return batch, reference_steps(SETTINGS, agg_modes=(AGG_MODE,))[AGG_MODE], reference_log_probs(SETTINGS, batch)


@pytest.mark.parametrize("dp, sp", [(4, 1), (2, 2), (1, 4)])
def test_worker_group_matches_single_process_reference(ray_cluster, reference, dp, sp, tmp_path):
    batch, ref, ref_log_probs = reference
    plan = plan_balance(
        seq_lens=batch["attention_mask"].sum(1).numpy(),
        dp_size=dp,
        sp_size=sp,
        max_token_len_per_gpu=-(-SETTINGS.tokens_per_micro_batch // sp),
        balance=True,
    )
    # The plan must actually reorder samples, or "returned in input order" would be vacuous.
    assert not np.array_equal(plan.order, np.arange(len(plan.order)))
    chunks = split_by_plan(Batch.from_dict(tensors=batch), plan)
    group = _group(sp)
    try:
        log_probs = merge_by_plan(group.compute_log_prob(chunks), plan)["log_probs"]
        torch.testing.assert_close(log_probs, ref_log_probs, rtol=1e-5, atol=1e-5)

        eval_metrics = group.eval_loss(chunks)
        assert len(eval_metrics) == dp  # one output per DP group (SP rank 0 only)
        assert eval_metrics[0]["loss"] == pytest.approx(ref["loss"], rel=1e-5)

        train_metrics = group.update_actor(chunks)
        assert train_metrics[0]["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        assert train_metrics[0]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)

        if (dp, sp) == (2, 2):
            # save -> one more step; a fresh group loaded from the save must take the same step
            group.save_checkpoint(str(tmp_path / "ckpt"), 1)
            next_loss = group.update_actor(chunks)[0]["loss"]
            _close(group)
            group = _group(sp)
            group.load_checkpoint(str(tmp_path / "ckpt"))
            assert group.update_actor(chunks)[0]["loss"] == next_loss
    finally:
        _close(group)
