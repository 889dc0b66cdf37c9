"""Our actor driven by verl's own single controller: RayClassWithInitArgs + RayWorkerGroup, 2 CPU workers.

One worker group (dp=2) for the whole module. The reference for log-probs is the same group under
a different layout of the same rows (fixed micro-batches vs our balanced plan with reordered rows):
outputs must agree row by row, so they also prove rows come back in input order.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)
ray = pytest.importorskip("ray")

from verl import DataProto  # noqa: E402
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup  # noqa: E402

from verl_balance.engine.config import EngineConfig, OptimConfig  # noqa: E402
from verl_balance.integrations import verl as integration  # noqa: E402
from verl_balance.models.config import ModelConfig  # noqa: E402
from verl_balance.workers.actor import ActorWorkerConfig  # noqa: E402

pytestmark = pytest.mark.slow

NUM_WORKERS = 2
AUTOPATCH = "verl_balance.integrations.verl.autopatch"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# What docs/verl.md tells users to export (verl imports it inside `import verl` in every process),
# set on this module's actors and tasks only: the session's one Ray cluster (tests/conftest.py) serves them.
PATCHED_RUNTIME_ENV = {
    "env_vars": {
        "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p),
        "OMP_NUM_THREADS": "1",
        "VERL_BALANCE_NUM_THREADS": "1",
        "VERL_USE_EXTERNAL_MODULES": AUTOPATCH,
    }
}


@pytest.fixture(scope="module")
def worker_group(ray_cluster):
    config = ActorWorkerConfig(
        model=ModelConfig.preset("tiny"), engine=EngineConfig(optim=OptimConfig(lr=1e-2), seed=0)
    )
    # max_colocate_count=1: one CPU per bundle (verl's default reserves 10 CPUs per worker).
    pool = RayResourcePool([NUM_WORKERS], use_gpu=False, max_colocate_count=1)
    cls = RayClassWithInitArgs(cls=ray.remote(integration.VerlActorWorker), config=config, micro_batch_size_per_gpu=2)
    cls.update_options({"runtime_env": PATCHED_RUNTIME_ENV})
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name="cpu")
    group.init_model()
    yield group
    for handle in group.workers:
        ray.kill(handle)
    for placement_group in pool.get_placement_groups():
        ray.util.remove_placement_group(placement_group)


def _sft_batch(num_rows=8, width=24, seed=0) -> DataProto:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, width + 1, (num_rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    input_ids = torch.randint(1, 128, (num_rows, width), generator=gen) * mask
    loss_mask = mask.clone()
    loss_mask[:, :2] = 0  # the first tokens are the "prompt"
    return DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": mask, "loss_mask": loss_mask.float()},
        non_tensors={"sample_id": np.array([f"s{i}" for i in range(num_rows)], dtype=object)},
    )


def test_trainer_reads_dp_size_from_the_actor_mesh(worker_group):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    stub = type("Stub", (), {"_get_dp_size": RayPPOTrainer._get_dp_size})()
    assert stub._get_dp_size(worker_group, "actor") == NUM_WORKERS


def test_external_modules_env_patches_verl_in_every_ray_worker(worker_group):
    @ray.remote(num_cpus=0, runtime_env=PATCHED_RUNTIME_ENV)
    def patched_names():
        import verl.trainer.ppo.ray_trainer as ray_trainer
        import verl.workers.engine.utils as engine_utils

        return {engine_utils.rearrange_micro_batches.__module__, ray_trainer.RayPPOTrainer._balance_batch.__module__}

    assert ray.get(patched_names.remote()) == {
        "verl_balance.integrations.verl.patches.seqlen",
        "verl_balance.integrations.verl.patches.trainer_balance",
    }


def test_log_probs_are_layout_invariant_and_in_input_order(worker_group):
    data = _sft_batch()
    fixed = worker_group.compute_log_prob(data).batch["old_log_probs"]
    assert fixed.shape == data.batch["input_ids"].shape

    balanced = _sft_batch()
    balanced.batch["row"] = torch.arange(len(balanced))
    integration.balance_batch(balanced, dp_size=NUM_WORKERS, max_token_len_per_gpu=40)
    out = worker_group.compute_log_prob(balanced).batch["old_log_probs"]
    back = torch.empty_like(out)
    back[balanced.batch["row"]] = out
    torch.testing.assert_close(back, fixed, rtol=1e-5, atol=1e-6)
    padding = ~data.batch["attention_mask"].bool()
    assert torch.all(fixed[padding] == 0) and torch.all(fixed[:, 0] == 0)
    # negative control: a different row order does change what comes back
    assert not torch.allclose(fixed, fixed.roll(1, dims=0))


def test_update_actor_returns_metrics_and_trains(worker_group, tmp_path):
    data = _sft_batch(seed=1)
    before = worker_group.compute_log_prob(data).batch["old_log_probs"]
    worker_group.save_checkpoint(local_path=str(tmp_path / "ckpt"), global_step=0)

    output = worker_group.update_actor(data)
    metrics = output.meta_info["metrics"]
    assert len(metrics["loss"]) == NUM_WORKERS  # one entry per collecting (SP rank 0) worker
    # the loss is the exact global loss, so every DP rank reports the same number
    assert metrics["loss"][0] == pytest.approx(metrics["loss"][1], rel=1e-6)
    nll = -(before * data.batch["loss_mask"]).sum() / data.batch["loss_mask"].sum()
    assert metrics["loss"][0] == pytest.approx(float(nll), rel=1e-5)

    after = worker_group.compute_log_prob(data).batch["old_log_probs"]
    assert not torch.allclose(after, before)
    worker_group.load_checkpoint(local_path=str(tmp_path / "ckpt"))
    restored = worker_group.compute_log_prob(data).batch["old_log_probs"]
    torch.testing.assert_close(restored, before, rtol=1e-6, atol=1e-6)
