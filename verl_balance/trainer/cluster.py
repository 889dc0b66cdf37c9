"""Ray start-up (embedded or an existing cluster), device detection, and placing and releasing a worker group."""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping

import ray

from verl_balance.single_controller import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    UnplaceableResourcePoolError,
)
from verl_balance.trainer import ray_start
from verl_balance.trainer.config import ConfigError, TrainerSection
from verl_balance.trainer.config.ray_init import RAY_INIT_KEY, check_ray_init, merge_ray_init
from verl_balance.trainer.ray_start import (
    CPU_WORKERS_PER_CORE,
    embedded_cluster_cpus,
    embedded_defaults,
    environment_address,
    plain_worker_prefixes,
    worker_runtime_env,
)
from verl_balance.trainer.signals import stop_signals_blocked
from verl_balance.utils.progress import TimedPhase
from verl_balance.workers.actor import ActorWorker, ActorWorkerConfig
from verl_balance.workers.group import group_class_for

logger = logging.getLogger(__name__)


def start_ray(*, address: str | None, num_workers: int | None = None, ray_init: Mapping | None = None) -> None:
    """Connect to a cluster (``address``) or start an embedded one sized to this machine (or take the one the
    entry point started early with the same arguments: ``ray_start``).

    The embedded cluster has ``embedded_cluster_cpus()`` CPU slots (and the GPUs Ray detects), so a
    worker group that cannot fit fails at once with ``UnplaceableResourcePoolError``. ``num_workers``
    only serves an oversubscription warning. ``ray_init`` (verl's ``ray_kwargs.ray_init``) is merged
    over these choices (``ray_init.merge_ray_init``)."""
    embedded, kwargs = ray_init_arguments(address=address, ray_init=ray_init)
    adopted = ray_start.take_early_start(kwargs if embedded else None)
    if not adopted:
        if ray.is_initialized():
            return
        plain_worker_prefixes(sys.stdout)
        if not embedded:
            with stop_signals_blocked():  # keeps this driver's SIGTERM handler (not Ray's sys.exit(15))
                ray.init(**kwargs)
            return
        ray_start.start_embedded(kwargs)
    cpus = kwargs["num_cpus"]
    cores = embedded_cluster_cpus() // CPU_WORKERS_PER_CORE
    if num_workers is not None and cores < num_workers <= cpus and ray.cluster_resources().get("GPU", 0) == 0:
        logger.warning(
            "%d CPU workers on %d core(s): they share the cores (the embedded cluster offers %d CPU slots)",
            num_workers,
            cores,
            cpus,
        )


def ray_init_arguments(*, address: str | None, ray_init: Mapping | None) -> tuple[bool, dict]:
    """(whether the cluster is embedded, ``ray.init``'s arguments with the user's ``ray_init`` merged over ours)."""
    # RAY_ADDRESS joins that cluster, as Ray's own ray.init() would (never with num_cpus: Ray refuses it).
    address = _address(address, check_ray_init(ray_init).get("address")) or environment_address()
    if address:
        return False, merge_ray_init(
            {"address": address, "runtime_env": worker_runtime_env(), "log_to_driver": True}, ray_init
        )
    return True, merge_ray_init(embedded_defaults(), ray_init)


def _address(address: str | None, ray_init_address: str | None) -> str | None:
    """trainer.ray_address, or its other spelling ray_kwargs.ray_init.address (both set: the same)."""
    if address and ray_init_address and address != ray_init_address:
        raise ConfigError(
            f"trainer.ray_address={address!r} and {RAY_INIT_KEY}.address={ray_init_address!r} name two "
            "clusters; set one of them"
        )
    return address or ray_init_address


def resolve_use_gpu(device: str) -> bool:
    """trainer.device auto|cpu|cuda -> whether workers take GPU bundles (auto: the cluster has GPUs)."""
    if device == "cpu":
        return False
    gpus = ray.cluster_resources().get("GPU", 0)
    if device == "cuda" and gpus == 0:
        raise ConfigError("trainer.device=cuda but the Ray cluster has no GPUs; use trainer.device=cpu or auto")
    return gpus > 0


class ClusterTooSmallError(ConfigError, UnplaceableResourcePoolError):
    """The worker group the trainer keys ask for does not fit the Ray cluster (names the keys)."""


def describe_parameters(init_info) -> str:
    """``1.23M parameters`` (with LoRA's trainable share) from rank 0's ``init_model`` answer; "" without counts."""
    info = init_info[0] if isinstance(init_info, list) and init_info else init_info
    if not isinstance(info, dict) or "parameters" not in info:
        return ""
    total, trainable = info["parameters"], info.get("trainable_parameters", info["parameters"])
    if trainable == total:
        return f"{_count(total)} parameters"
    return f"LoRA: {_count(trainable)} trainable of {_count(total)} parameters ({100.0 * trainable / total:.2f}%)"


def describe_rollout_startup(init_info) -> str:
    """``; 2 vLLM engines started (slowest 31.2 s)`` from the workers' ``init_model`` answers; "" when none."""
    infos = init_info if isinstance(init_info, list) else [init_info]
    seconds = [i["rollout_startup_s"] for i in infos if isinstance(i, dict) and i.get("rollout_startup_s") is not None]
    if not seconds:
        return ""
    return f"; {len(seconds)} vLLM engine{'s' * (len(seconds) > 1)} started (slowest {max(seconds):.1f} s)"


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def build_actor_group(
    *,
    worker_config: ActorWorkerConfig,
    trainer_cfg: TrainerSection,
    use_gpu: bool,
    worker_cls: type = ActorWorker,
    cpu_workers_per_node: int | None = None,
) -> RayWorkerGroup:
    """Place nnodes x n_gpus_per_node workers and build the sharded model on them, logging ``worker spawn`` and
    ``model load``; ``cpu_workers_per_node``: CPU workers of all groups running at once on a node."""
    pool = RayResourcePool(
        n_gpus_per_node=trainer_cfg.n_gpus_per_node,
        nnodes=trainer_cfg.nnodes,
        use_gpu=use_gpu,
        cpu_workers_per_node=cpu_workers_per_node,
        placement_timeout_s=trainer_cfg.placement_timeout_s,
    )
    try:
        spawn = TimedPhase("worker spawn", f"{trainer_cfg.n_gpus_per_node * trainer_cfg.nnodes} {worker_cls.__name__}s")
        with spawn:
            group = group_class_for(worker_cls)(
                resource_pool=pool,
                ray_cls_with_init=RayClassWithInitArgs(worker_cls, worker_config),
                # getattr: benchmarks and tests pass a SimpleNamespace with the placement keys only
                call_timeout_s=getattr(trainer_cfg, "worker_call_timeout_s", TrainerSection.worker_call_timeout_s),
                heartbeat_s=getattr(trainer_cfg, "heartbeat_interval_s", TrainerSection.heartbeat_interval_s),
                timeout_hint="trainer.worker_call_timeout_s sets this limit",
            )
    except UnplaceableResourcePoolError as err:
        pool.remove()
        n, nodes = trainer_cfg.n_gpus_per_node, trainer_cfg.nnodes
        raise ClusterTooSmallError(
            f"trainer.n_gpus_per_node={n} x trainer.nnodes={nodes} = {n * nodes} workers do not fit the Ray "
            f"cluster: {err}. Lower trainer.n_gpus_per_node (or trainer.nnodes), or use a larger cluster"
        ) from err
    except BaseException:
        pool.remove()
        raise
    try:
        with TimedPhase("model load") as phase:
            group.init_info = group.init_model()  # per rank: layout, device, parameter counts
            phase.detail = describe_parameters(group.init_info) + describe_rollout_startup(group.init_info)
    except BaseException:  # the workers are alive: stop them and free their placement before raising
        release_group(group)
        raise
    return group


def release_group(group: RayWorkerGroup, *, broken: str | None = None) -> None:
    """Stop ``group``'s workers and free its placement (Ray stays up); ``broken`` (its name): best effort, logged."""
    for release in (group.shutdown, group.resource_pool.remove):
        if broken is None:
            release()
            continue
        try:
            release()
        except Exception as err:  # the group is broken already; freeing it is best effort
            logger.warning("restart: releasing %s failed: %s", broken, err)
