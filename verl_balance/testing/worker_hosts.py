"""Warm worker processes (test suite only): successive worker groups of one driver reuse idle worker
processes instead of paying an interpreter, torch and the worker's imports (about 3 s of CPU) each.

With ``enable_worker_hosts(classes=...)`` a worker of those classes lives inside a *host*
(``testing/worker_host.py``'s ``WorkerHost``), a Ray actor that outlives the group and serves the next
group's worker of the same class, options and environment. A hosted worker starts as a fresh actor
would (environment, process groups, seeds and torch defaults reset; an unresettable host is killed),
except for its pid and constructor errors surfacing in the group's start-up call.

A group that saw any failure, or whose release does not answer within ``RELEASE_TIMEOUT_S``, kills its
hosts. Only CPU groups without a controller extension are hosted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray

from verl_balance.single_controller.worker_factory import install_worker_factory, installed_worker_factory

__all__ = ["WorkerHosts", "enable_worker_hosts", "disable_worker_hosts", "worker_hosting", "active_hosts"]

# A clean group's hosts answer their release within this; one that does not is killed.
RELEASE_TIMEOUT_S = 30.0
# Idle hosts kept over all worker classes; the oldest are killed first.
MAX_IDLE_HOSTS = 8
# The rendezvous variables differ per rank and group; every other variable picks the host.
RANK_VARIABLES = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
_HOST_METHODS = ("host_start", "host_stop")  # what a host class adds to the worker's methods


def _forwarder(name: str):
    def forward(self, *args, **kwargs):
        return getattr(self._worker, name)(*args, **kwargs)

    forward.__name__ = name
    return forward


def _host_class(cls: type, host: type) -> type:
    """A subclass of ``host`` whose other methods are ``cls``'s methods, forwarded to the worker object."""
    names = [
        name
        for name in dir(cls)
        if not name.startswith("__") and name not in _HOST_METHODS and callable(getattr(cls, name, None))
    ]
    namespace = {name: _forwarder(name) for name in names}
    return type(f"Hosted{cls.__name__}", (host,), namespace)


class WorkerHosts:
    """The driver's hosts: idle ones by (worker class, actor options, environment), and the busy ones."""

    def __init__(self, classes: tuple[type, ...], *, host: type) -> None:
        self.classes = tuple(classes)
        self.host = host
        self._remote_classes: dict[type, Any] = {}
        self._idle: dict[tuple, list[Any]] = {}
        self._key_of: dict[Any, tuple] = {}  # host actor id -> its key
        self._job_id: str | None = None

    def accepts(self, cls: type, *, use_gpu: bool, has_extension: bool) -> bool:
        """Whether a group of ``cls`` workers is hosted (exact class; CPU groups without extension)."""
        return cls in self.classes and not use_gpu and not has_extension

    def start_worker(self, cls: type, *, options: dict, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        """(host handle, ref of its start-up call) for one worker with the group's actor ``options``."""
        self._forget_other_clusters()
        env = dict(options.get("runtime_env", {}).get("env_vars", {}))
        host_env = {k: v for k, v in env.items() if k not in RANK_VARIABLES}
        host_options = {
            k: v for k, v in options.items() if k not in ("scheduling_strategy", "name", "num_cpus", "num_gpus")
        }
        host_options["runtime_env"] = {**options.get("runtime_env", {}), "env_vars": host_env}
        key = (cls, repr(sorted(host_options.items(), key=lambda item: item[0])))
        idle = self._idle.get(key, [])
        host = idle.pop() if idle else self._new_host(cls, host_options, key)
        rank_env = {k: v for k, v in env.items() if k in RANK_VARIABLES}
        return host, host.host_start.remote(cls, rank_env, args, kwargs)

    def _new_host(self, cls: type, host_options: dict, key: tuple) -> Any:
        if cls not in self._remote_classes:
            self._remote_classes[cls] = ray.remote(_host_class(cls, self.host))
        host = self._remote_classes[cls].options(num_cpus=0, **host_options).remote()
        self._key_of[host._actor_id.hex()] = key
        return host

    def release(self, hosts: list[Any], *, clean: bool) -> None:
        """Make ``hosts`` idle again after a clean shutdown (killed if not clean or not answering)."""
        if not hosts:
            return
        if not clean or active_hosts() is not self:
            self._kill(hosts)
            return
        refs = [host.host_stop.remote() for host in hosts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=RELEASE_TIMEOUT_S)
        stopped = set()
        for host, ref in zip(hosts, refs):
            if ref in ready:
                try:
                    if ray.get(ref):  # False: the host cannot be reset
                        stopped.add(host._actor_id.hex())
                except ray.exceptions.RayError:
                    pass
        self._kill([h for h in hosts if h._actor_id.hex() not in stopped])
        for host in hosts:
            if host._actor_id.hex() in stopped:
                self._idle.setdefault(self._key_of[host._actor_id.hex()], []).insert(0, host)
        self._trim()

    def _trim(self) -> None:
        while sum(len(v) for v in self._idle.values()) > MAX_IDLE_HOSTS:
            key = max(self._idle, key=lambda k: len(self._idle[k]))
            self._kill([self._idle[key].pop()])

    def _kill(self, hosts: list[Any]) -> None:
        for host in hosts:
            self._key_of.pop(host._actor_id.hex(), None)
            ray.kill(host, no_restart=True)

    def _forget_other_clusters(self) -> None:
        """Handles of an earlier Ray session (``ray.shutdown`` then ``ray.init``) are not reused."""
        job_id = ray.get_runtime_context().get_job_id()
        if job_id != self._job_id:
            self._idle.clear()
            self._key_of.clear()
            self._job_id = job_id

    def shutdown(self) -> None:
        """Kill every idle host."""
        if ray.is_initialized() and ray.get_runtime_context().get_job_id() == self._job_id:
            self._kill([host for idle in self._idle.values() for host in idle])
        self._idle.clear()


def active_hosts() -> WorkerHosts | None:
    """The driver's hosts, or None when hosting is off (the default)."""
    factory = installed_worker_factory()
    return factory if isinstance(factory, WorkerHosts) else None


def enable_worker_hosts(*, classes: tuple[type, ...], host: type) -> WorkerHosts:
    """Host the workers of exactly these classes in ``host`` processes from now on."""
    disable_worker_hosts()
    hosts = WorkerHosts(classes, host=host)
    install_worker_factory(hosts)
    return hosts


def disable_worker_hosts() -> None:
    """Stop hosting; idle hosts are killed (busy ones are killed when their group shuts down)."""
    hosts = active_hosts()
    if hosts is not None:
        install_worker_factory(None)
        hosts.shutdown()


@contextmanager
def worker_hosting(*, classes: tuple[type, ...], host: type) -> Iterator[WorkerHosts]:
    """Hosting of ``classes`` for the block; the previous factory afterwards."""
    hosts = WorkerHosts(classes, host=host)
    previous = install_worker_factory(hosts)
    try:
        yield hosts
    finally:
        hosts.shutdown()
        install_worker_factory(previous)
