"""Scenarios that need a Ray cluster of their own, run in a fresh interpreter by test_multinode.py.

The test session's embedded Ray (tests/conftest.py) is one node; these scenarios start their own
cluster (``ray.cluster_utils.Cluster``: several raylets with distinct resources on this machine, or
the trainer's embedded cluster), so they must not share the test process. Each prints one JSON
line with what it measured; the assertions live in the test. ``single_node_run``, the two-node
run's reference, needs no cluster of its own: the test runs it on the session's cluster.

    python -m tests.single_controller.cluster_scenarios multinode
    python -m tests.single_controller.cluster_scenarios oversized
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_ROWS = 8
NUM_STEPS = 2
SP_SIZE = 2


def _runtime_env() -> dict:
    python_path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}}


def _dp_chunks(dp: int, step: int) -> list:
    """The global batch of ``step`` as ``dp`` DP chunks of two micro-batches each (rows in order)."""
    from verl_balance.batch_keys import MICRO_BATCH_SIZES_KEY
    from verl_balance.models.config import ModelConfig
    from verl_balance.protocol import Batch

    gen = torch.Generator().manual_seed(100 + step)
    width = 24
    lengths = torch.randint(6, width + 1, (NUM_ROWS,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = torch.randint(1, ModelConfig.preset("tiny").vocab_size, (NUM_ROWS, width), generator=gen) * mask
    loss_mask = mask.clone().float()
    loss_mask[:, :3] = 0
    rows_per_dp = NUM_ROWS // dp
    chunks = []
    for d in range(dp):
        part = slice(d * rows_per_dp, (d + 1) * rows_per_dp)
        chunks.append(
            Batch.from_dict(
                tensors={"input_ids": ids[part], "attention_mask": mask[part], "loss_mask": loss_mask[part]},
                meta={MICRO_BATCH_SIZES_KEY: [rows_per_dp // 2, rows_per_dp - rows_per_dp // 2]},
            )
        )
    return chunks


def _train(pool) -> dict:
    """Place an ActorWorker group (dp x sp=2) on ``pool``, take NUM_STEPS steps, return ranks and losses."""
    from verl_balance.engine.config import EngineConfig, OptimConfig
    from verl_balance.models.config import ModelConfig
    from verl_balance.single_controller import RayClassWithInitArgs, RayWorkerGroup
    from verl_balance.workers.actor import ActorWorker, ActorWorkerConfig

    engine = EngineConfig(optim=OptimConfig(lr=1e-2), seed=0)
    config = ActorWorkerConfig(model=ModelConfig.preset("tiny"), engine=engine, sp_size=SP_SIZE)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorWorker, config))
    try:
        layout = group.init_model()
        infos = group.get_rank_info()
        dp = group.world_size // SP_SIZE
        losses = []
        for step in range(NUM_STEPS):
            metrics = group.update_actor(_dp_chunks(dp, step))
            losses.append([m["loss"] for m in metrics])
        return {
            "node_of_rank": [i["node_id"] for i in infos],
            "local_rank": [i["local_rank"] for i in infos],
            "dp_sp_of_rank": [[x["dp_rank"], x["sp_rank"]] for x in layout],
            "pg_nodes": pool.node_ids(),
            "losses": losses,
        }
    finally:
        group.shutdown()
        pool.remove()


def single_node_run() -> dict:
    """The same training on one node of 4 workers: the reference of the two-node run (any cluster)."""
    from verl_balance.single_controller import RayResourcePool

    return _train(RayResourcePool(n_gpus_per_node=4, nnodes=1, use_gpu=False, placement_timeout_s=300))


def multinode() -> dict:
    """One node first (nnodes=2 must fail), then two nodes: placement per node and the training run
    (its single-node reference, ``single_node_run``, runs on the test session's cluster)."""
    import ray
    from ray.cluster_utils import Cluster

    from verl_balance.single_controller import RayResourcePool, UnplaceableResourcePoolError

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4})
    try:
        ray.init(address=cluster.address, runtime_env=_runtime_env(), log_to_driver=False)
        head = ray.get_runtime_context().get_node_id()
        out: dict = {"head": head}
        start = time.monotonic()
        try:
            RayResourcePool(n_gpus_per_node=2, nnodes=2, use_gpu=False, placement_timeout_s=60).get_placement_groups()
            out["one_node_error"] = None
        except UnplaceableResourcePoolError as error:
            out["one_node_error"] = str(error)
        out["one_node_error_s"] = time.monotonic() - start

        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        out["multi"] = _train(RayResourcePool(n_gpus_per_node=2, nnodes=2, use_gpu=False, placement_timeout_s=120))
        out["nodes"] = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


def oversized() -> dict:
    """The trainer's embedded cluster asked for 64 workers on this machine: error at once, nothing spawned."""
    from types import SimpleNamespace

    import ray

    from verl_balance.engine.config import EngineConfig
    from verl_balance.models.config import ModelConfig
    from verl_balance.single_controller import UnplaceableResourcePoolError
    from verl_balance.trainer import cluster, ray_start
    from verl_balance.workers.actor import ActorWorkerConfig

    start = time.monotonic()
    cluster.start_ray(address=None, num_workers=64)
    out: dict = {"cluster_cpus": ray.cluster_resources().get("CPU"), "expected_cpus": ray_start.embedded_cluster_cpus()}
    config = ActorWorkerConfig(model=ModelConfig.preset("tiny"), engine=EngineConfig())
    trainer_cfg = SimpleNamespace(n_gpus_per_node=64, nnodes=1, placement_timeout_s=300.0)
    out["start_ray_s"] = time.monotonic() - start
    out["worker_niceness"] = ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote())
    out["driver_niceness"] = os.nice(0)
    start = time.monotonic()
    try:
        cluster.build_actor_group(worker_config=config, trainer_cfg=trainer_cfg, use_gpu=False)
        out["error"] = None
    except UnplaceableResourcePoolError as error:
        out["error"] = str(error)
    out["placement_s"] = time.monotonic() - start
    out["free_cpus_after"] = ray.available_resources().get("CPU")
    ray.shutdown()
    return out


if __name__ == "__main__":
    scenario = {"multinode": multinode, "oversized": oversized}[sys.argv[1]]
    print("RESULT " + json.dumps(scenario()), flush=True)
