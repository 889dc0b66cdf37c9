"""Ray start-up (embedded or an existing cluster), device detection and the actor worker group."""

from __future__ import annotations

import os

import ray

from verl_balance.single_controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl_balance.trainer.config import ConfigError
from verl_balance.workers.actor import ActorWorker, ActorWorkerConfig


def start_ray(*, address: str | None, num_workers: int) -> None:
    """Connect to a cluster (``address``) or start an embedded one sized for the workers."""
    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        # An embedded cluster gets one CPU slot per worker plus one for the driver's tasks, even
        # on a 2-core laptop: the workers are mostly waiting on each other's collectives.
        ray.init(num_cpus=max(num_workers + 1, os.cpu_count() or 1), include_dashboard=False,
                 runtime_env=env, log_to_driver=True)


def resolve_use_gpu(device: str) -> bool:
    """trainer.device auto|cpu|cuda -> whether workers take GPU bundles (auto: the cluster has GPUs)."""
    if device == "cpu":
        return False
    gpus = ray.cluster_resources().get("GPU", 0)
    if device == "cuda" and gpus == 0:
        raise ConfigError("trainer.device=cuda but the Ray cluster has no GPUs; use trainer.device=cpu or auto")
    return gpus > 0


def build_actor_group(*, worker_config: ActorWorkerConfig, trainer_cfg, use_gpu: bool,
                      worker_cls: type = ActorWorker) -> RayWorkerGroup:
    """Place nnodes x n_gpus_per_node workers and build the sharded model on them."""
    pool = RayResourcePool(n_gpus_per_node=trainer_cfg.n_gpus_per_node, nnodes=trainer_cfg.nnodes,
                           use_gpu=use_gpu, placement_timeout_s=trainer_cfg.placement_timeout_s)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(worker_cls, worker_config))
    group.init_model()
    return group
