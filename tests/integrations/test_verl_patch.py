"""patch_verl(): our balancer inside verl's modules and RayPPOTrainer, and a clean undo."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)
ray_trainer = pytest.importorskip(
    "verl.trainer.ppo.ray_trainer",
    reason="verl's RayPPOTrainer needs cachetools, uvicorn and fastapi (undeclared verl deps)",
)

import verl.utils.seqlen_balancing as verl_sb  # noqa: E402
import verl.workers.engine.utils as verl_engine_utils  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402

from verl_balance.balance import FlopsWorkload  # noqa: E402
from verl_balance.integrations import verl as integration  # noqa: E402
from verl_balance.integrations.verl.patches.state import PATCH_STATE  # noqa: E402
from verl_balance.integrations.verl.patches.trainer_balance import balanced_balance_batch  # noqa: E402
from verl_balance.integrations.verl.patches.workload import VerlWorkload  # noqa: E402

TARGETS = [
    (verl_sb, "get_seqlen_balanced_partitions"),
    (verl_sb, "rearrange_micro_batches"),
    (verl_sb, "get_reverse_idx"),
    (verl_engine_utils, "rearrange_micro_batches"),
    (ray_trainer, "get_seqlen_balanced_partitions"),
]


def _snapshot():
    functions = [owner.__dict__[name] for owner, name in TARGETS]
    return functions + [ray_trainer.RayPPOTrainer.__dict__["_balance_batch"]]


def test_patch_swaps_every_imported_name_and_undo_restores_the_originals():
    before = _snapshot()
    with integration.patch_verl() as handle:
        assert verl_sb.get_seqlen_balanced_partitions is integration.get_seqlen_balanced_partitions
        assert verl_sb.rearrange_micro_batches is integration.rearrange_micro_batches
        assert verl_engine_utils.rearrange_micro_batches is integration.rearrange_micro_batches
        assert ray_trainer.get_seqlen_balanced_partitions is integration.get_seqlen_balanced_partitions
        assert verl_sb.get_reverse_idx is integration.get_reverse_idx
        assert ray_trainer.RayPPOTrainer._balance_batch is balanced_balance_batch
        assert len(handle.patched) >= len(TARGETS) + 1
    after = _snapshot()
    assert all(a is b for a, b in zip(before, after))
    handle.undo()  # idempotent
    assert all(a is b for a, b in zip(before, _snapshot()))


def test_nested_patches_unwind_in_order():
    before = _snapshot()
    outer = integration.patch_verl(workload="tokens")
    inner = integration.patch_verl(workload=FlopsWorkload(2, 64, 128, 4, 2, 100))
    inner.undo()
    assert verl_sb.rearrange_micro_batches is integration.rearrange_micro_batches
    assert PATCH_STATE.workload == "tokens"
    outer.undo()
    assert all(a is b for a, b in zip(before, _snapshot()))
    assert PATCH_STATE.workload is None


def test_verl_engine_prepare_micro_batches_uses_our_packing():
    lengths = [3, 17, 9, 30, 2, 25, 11, 6, 14, 21, 4, 28]
    ids = [torch.arange(n) for n in lengths]
    data = verl_engine_utils.tu.get_tensordict(
        tensor_dict={"input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged)},
        non_tensor_dict={"use_dynamic_bsz": True, "max_token_len_per_gpu": 20, "sp_size": 2},
    )
    with integration.patch_verl():
        micro_batches, indices = verl_engine_utils.prepare_micro_batches(data)
    assert sorted(sum(indices, [])) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in idx) <= 40 for idx in indices)  # cap = per-GPU 20 * sp 2
    assert [len(mb) for mb in micro_batches] == [len(idx) for idx in indices]


# ----------------------------------------------------------------- RayPPOTrainer._balance_batch
class _StubTrainer:
    """The attributes RayPPOTrainer._balance_batch reads, without Ray."""

    def __init__(self, model_path, dp_size, mini_batch_size=8, n=1, use_dynamic_bsz=False):
        self.config = OmegaConf.create(
            {
                "actor_rollout_ref": {
                    "model": {"path": str(model_path)},
                    "actor": {
                        "ppo_mini_batch_size": mini_batch_size,
                        "use_dynamic_bsz": use_dynamic_bsz,
                        "ppo_max_token_len_per_gpu": 4096,
                        "ulysses_sequence_parallel_size": 1,
                    },
                    "rollout": {"n": n},
                }
            }
        )
        self.actor_rollout_wg = object()
        self._dp_size = dp_size

    def _get_dp_size(self, worker_group, role):
        return self._dp_size


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
    ).save_pretrained(path)
    return path


def _rollout_batch(num_rows, seed):
    rng = np.random.default_rng(seed)
    lengths = np.where(rng.random(num_rows) < 0.2, rng.integers(2000, 4000, num_rows), rng.integers(20, 400, num_rows))
    width = int(lengths.max())
    mask = (torch.arange(width)[None, :] < torch.as_tensor(lengths)[:, None]).long()
    return DataProto.from_dict(
        tensors={"input_ids": mask.clone(), "attention_mask": mask, "row_id": torch.arange(num_rows)},
        non_tensors={"uid": np.array([f"p{i // 4}" for i in range(num_rows)], dtype=object)},
        meta_info={"temperature": 1.0},
    ), lengths


def _max_rank_cost(batch, dp_size, workload):
    lengths = batch.batch["attention_mask"].sum(-1).numpy()
    return max(workload.cost(chunk).sum() for chunk in np.split(lengths, dp_size))


def _sync_cost_after_worker_split(batch, dp_size, cap, workload, rearrange):
    """What every rank waits for: per micro-batch slot the slowest rank, after each DP chunk is
    split by ``rearrange`` with a DP-agreed micro-batch count (as verl's engine does)."""
    chunks = batch.chunk(dp_size)
    count = max(len(rearrange(c.batch, cap)[1]) for c in chunks)
    rank_costs = []
    for chunk in chunks:
        costs = workload.cost(chunk.batch["attention_mask"].sum(-1).numpy())
        _, indices = rearrange(chunk.batch, cap, min_num_micro_batch=count)
        rank_costs.append([costs[idx].sum() for idx in indices])
    return np.max(np.array(rank_costs), axis=0).sum()


def test_workload_is_built_from_the_actor_model_config(llama_dir):
    workload = integration.workload_of_actor(_StubTrainer(llama_dir, dp_size=2))
    assert workload == FlopsWorkload(
        num_layers=4,
        hidden_size=256,
        intermediate_size=688,
        num_heads=8,
        num_kv_heads=4,
        vocab_size=1000,
        head_dim=workload.head_dim,
    )


@pytest.mark.parametrize("keep_minibatch, use_dynamic_bsz", [(False, False), (True, False), (False, True)])
def test_balance_batch_keeps_every_row_and_balances_verls_workload_at_least_as_well(
    llama_dir, keep_minibatch, use_dynamic_bsz
):
    dp_size, num_rows = 4, 32
    trainer = _StubTrainer(llama_dir, dp_size=dp_size, mini_batch_size=16, use_dynamic_bsz=use_dynamic_bsz)
    flops = VerlWorkload()  # the model both our DP partition and our packer weigh by by default
    theirs, _ = _rollout_batch(num_rows, seed=3)
    ray_trainer.RayPPOTrainer._balance_batch(trainer, theirs, metrics={}, keep_minibatch=keep_minibatch)

    ours, _ = _rollout_batch(num_rows, seed=3)
    metrics = {}
    with integration.patch_verl():
        ray_trainer.RayPPOTrainer._balance_batch(trainer, ours, metrics=metrics, keep_minibatch=keep_minibatch)
    assert sorted(ours.batch["row_id"].tolist()) == list(range(num_rows))
    for column in ours.non_tensor_batch.values():  # non-tensors moved with their rows
        assert list(column) == [f"p{i // 4}" for i in ours.batch["row_id"].tolist()]
    if keep_minibatch:  # every mini-batch keeps its own rows
        for r in range(dp_size):
            share = ours.batch["row_id"][r * 8 : (r + 1) * 8].tolist()
            assert all(i < 16 for i in share[:4]) and all(i >= 16 for i in share[4:]), share
    if use_dynamic_bsz:
        # what the workers then run: each chunk re-split by rearrange_micro_batches (ours once patched)
        ours_sync = _sync_cost_after_worker_split(ours, dp_size, 4096, flops, integration.rearrange_micro_batches)
        verl_sync = _sync_cost_after_worker_split(theirs, dp_size, 4096, flops, verl_sb.rearrange_micro_batches)
        assert ours_sync <= verl_sync * (1 + 1e-9)
    else:
        assert _max_rank_cost(ours, dp_size, flops) <= _max_rank_cost(theirs, dp_size, flops) * (1 + 1e-9)
    assert {"global_seqlen/balanced_max", "global_seqlen/min", "verl_balance/imbalance"} <= set(metrics)
    planned = ours.meta_info["verl_balance/micro_batch_sizes"]
    assert len(planned) == dp_size and all(sum(sizes) == num_rows // dp_size for sizes in planned)
