"""Ray start-up (embedded or an existing cluster), device detection, and placing and releasing a worker group."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
from collections.abc import Iterator, Mapping

import ray

from verl_balance.single_controller import (
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    UnplaceableResourcePoolError,
)
from verl_balance.trainer.config import ConfigError, TrainerSection
from verl_balance.trainer.config.ray_init import RAY_INIT_KEY, check_ray_init, merge_ray_init
from verl_balance.trainer.signals import stop_signals_blocked
from verl_balance.utils.progress import TimedPhase
from verl_balance.workers.actor import ActorWorker, ActorWorkerConfig
from verl_balance.workers.group import group_class_for

logger = logging.getLogger(__name__)
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"

CPU_WORKERS_PER_CORE = 4
"""CPU slots an embedded cluster offers per core (CPU workers mostly wait on collectives)."""


def embedded_cluster_cpus() -> int:
    """CPU slots of an embedded cluster: sized to this machine (cores usable by this process), never to a request."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return CPU_WORKERS_PER_CORE * max(1, cores)


EMBEDDED_WORKER_NICENESS = 0
"""Niceness of the embedded cluster's workers (Ray's default 15 lets other processes pre-empt the ranks)."""


INLINE_ARGUMENT_BYTES = 1 << 20
"""The embedded cluster's ``max_direct_call_object_size``: arguments up to it travel inline, not via the store."""


def start_ray(*, address: str | None, num_workers: int | None = None, ray_init: Mapping | None = None) -> None:
    """Connect to a cluster (``address``) or start an embedded one sized to this machine.

    The embedded cluster has ``embedded_cluster_cpus()`` CPU slots (and the GPUs Ray detects), so a
    worker group that cannot fit fails at once with ``UnplaceableResourcePoolError``. ``num_workers``
    only serves an oversubscription warning. ``ray_init`` (verl's ``ray_kwargs.ray_init``) is merged
    over these choices (``ray_init.merge_ray_init``)."""
    if ray.is_initialized():
        return
    plain_worker_prefixes(sys.stdout)
    embedded, kwargs = ray_init_arguments(address=address, ray_init=ray_init)
    if not embedded:
        with stop_signals_blocked():  # keeps this driver's SIGTERM handler (not Ray's sys.exit(15))
            ray.init(**kwargs)
        return
    # Ray warns on every start that it enabled token authentication (its default): a notice for the
    # embedded cluster's log, not a warning on every run's console.
    logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)
    with stop_signals_blocked(), dynamic_agent_port():  # the cluster's processes ignore a group SIGTERM / SIGINT
        _init_embedded(**kwargs)
    _stop_without_sigterm_at_shutdown()
    cpus = kwargs["num_cpus"]
    cores = embedded_cluster_cpus() // CPU_WORKERS_PER_CORE
    if num_workers is not None and cores < num_workers <= cpus and ray.cluster_resources().get("GPU", 0) == 0:
        logger.warning(
            "%d CPU workers on %d core(s): they share the cores (the embedded cluster offers %d CPU slots)",
            num_workers,
            cores,
            cpus,
        )


WORKER_WARNINGS = "ignore::FutureWarning"
"""The workers' ``PYTHONWARNINGS`` unless the user set one (libraries' FutureWarnings, once per worker, are noise)."""


def worker_warning_env() -> dict[str, str]:
    """{"PYTHONWARNINGS": WORKER_WARNINGS}, or {} when the user set PYTHONWARNINGS."""
    return {} if os.environ.get("PYTHONWARNINGS") else {"PYTHONWARNINGS": WORKER_WARNINGS}


def plain_worker_prefixes(stream) -> None:
    """On a ``stream`` that is not a terminal, drop Ray's colour codes from worker prefixes unless the user chose."""
    if not stream.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


EMBEDDED_START_CONFIG = {"prestart_worker_first_driver": False, "enable_metrics_collection": False}
"""Start-up work the embedded cluster skips (prestarted idle workers, metrics export); ``_system_config`` overrides."""


def ray_init_arguments(*, address: str | None, ray_init: Mapping | None) -> tuple[bool, dict]:
    """(whether the cluster is embedded, ``ray.init``'s arguments with the user's ``ray_init`` merged over ours)."""
    # RAY_ADDRESS joins that cluster, as Ray's own ray.init() would (never with num_cpus: Ray refuses it);
    # RAY_ADDRESS=local asks for a new embedded cluster, which is what no address gives.
    env_address = os.environ.get("RAY_ADDRESS") if os.environ.get("RAY_ADDRESS") != "local" else None
    address = _address(address, check_ray_init(ray_init).get("address")) or env_address or None
    # No progress bars in the workers: Ray would print them late, after the driver's lines.
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **worker_warning_env()}}
    if address:
        return False, merge_ray_init({"address": address, "runtime_env": env, "log_to_driver": True}, ray_init)
    defaults = dict(
        # Without an address Ray would join the last `ray start` cluster on this machine (its
        # /tmp/ray/ray_current_cluster file, even a dead one) and then refuse num_cpus.
        address="local",
        num_cpus=embedded_cluster_cpus(),
        include_dashboard=False,
        runtime_env=env,
        log_to_driver=True,
        _system_config={
            "worker_niceness": EMBEDDED_WORKER_NICENESS,
            "max_direct_call_object_size": INLINE_ARGUMENT_BYTES,
            **EMBEDDED_START_CONFIG,
        },
    )
    return True, merge_ray_init(defaults, ray_init)


def _address(address: str | None, ray_init_address: str | None) -> str | None:
    """trainer.ray_address, or its other spelling ray_kwargs.ray_init.address (both set: the same)."""
    if address and ray_init_address and address != ray_init_address:
        raise ConfigError(
            f"trainer.ray_address={address!r} and {RAY_INIT_KEY}.address={ray_init_address!r} name two "
            "clusters; set one of them"
        )
    return address or ray_init_address


EMBEDDED_START_ATTEMPTS = 3
"""Tries of the embedded cluster's start when Ray's fixed 30 s node-registration wait times out."""

_START_TIMEOUT_TEXTS = ("timed out during startup", "waiting for node to startup", "Timed out")


class RayStartError(RuntimeError):
    """The embedded Ray cluster did not start (names what timed out and the ways around it)."""


AGENT_PORT_PARAMETER = "dashboard_agent_listen_port"
"""Ray's node parameter for the dashboard agent's port (52365 by default, which a second Ray instance stalls on)."""


@contextlib.contextmanager
def dynamic_agent_port() -> Iterator[None]:
    """While in it, a Ray node started without an explicit agent port takes a free one (if Ray has the parameter)."""
    params = getattr(getattr(getattr(ray, "_private", None), "parameter", None), "RayParams", None)
    init = getattr(params, "__init__", None)
    if init is None or AGENT_PORT_PARAMETER not in inspect.signature(init).parameters:
        yield
        return

    def init_with_free_agent_port(self, *args, **kwargs):
        kwargs.setdefault(AGENT_PORT_PARAMETER, 0)
        init(self, *args, **kwargs)

    params.__init__ = init_with_free_agent_port
    try:
        yield
    finally:
        params.__init__ = init


def _init_embedded(**kwargs) -> None:
    """``ray.init(**kwargs)``, retried on a start-up timeout; then ``RayStartError`` naming what timed out."""
    for attempt in range(1, EMBEDDED_START_ATTEMPTS + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception as err:
            if not any(text in str(err) for text in _START_TIMEOUT_TEXTS):
                raise
            ray.shutdown()  # stop what the failed attempt started before trying again
            if attempt == EMBEDDED_START_ATTEMPTS:
                raise RayStartError(
                    f"the embedded Ray cluster did not start in {attempt} attempts: its node (raylet) did not "
                    f"register with Ray's GCS within Ray's fixed 30 s start-up limit ({err}); the machine is "
                    "probably overloaded. Retry when it is less busy, or start Ray yourself (ray start --head) "
                    "and set trainer.ray_address=auto"
                ) from err
            logger.warning(
                "embedded Ray start-up timed out (%s); retrying (attempt %d of %d)",
                err,
                attempt + 1,
                EMBEDDED_START_ATTEMPTS,
            )


def _stop_without_sigterm_at_shutdown() -> None:
    """Stop the embedded cluster's processes with SIGKILL at once (they block SIGTERM)."""
    node = getattr(getattr(ray, "_private", None) and ray._private.worker, "_global_node", None)
    kill_all = getattr(node, "kill_all_processes", None)
    if kill_all is None:
        return  # another Ray version: the shutdown keeps its graceful wait

    def kill_all_at_once(*args, **kwargs):
        kwargs["allow_graceful"] = False
        return kill_all(*args, **kwargs)

    node.kill_all_processes = kill_all_at_once


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
