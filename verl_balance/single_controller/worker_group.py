"""`RayWorkerGroup`: the driver's handle on one Ray actor per bundle of a `RayResourcePool`.

Every ``@register`` method of the worker class becomes a group method running dispatch -> execute ->
collect (``decorator.py``); ``group.method.submit(...)`` returns a ``GroupFuture`` without waiting.

Failure contract: the driver never waits on a worker that is gone. The first dead worker raises
``WorkerDiedError`` naming its rank, actor id and the method. An exception inside a worker method is
re-raised with its type plus a note naming rank and method, unless a peer of the same call is found
dead within ``failure_grace_s``: then ``WorkerDiedError``. A call unanswered within
``call_timeout_s`` raises ``WorkerTimeoutError`` naming the ranks; a heartbeat line every
``heartbeat_s`` names the ranks not answered yet. After either error the group's collectives are
broken: ``shutdown()`` it and build a new one.

The workers must import ``verl_balance`` (install it, or set ``PYTHONPATH`` for them).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl_balance.protocol import Batch
from verl_balance.single_controller.decorator import collect_outputs, dispatch_args, get_registration
from verl_balance.single_controller.extensions import extension_for_worker_class, pad_for_even_split
from verl_balance.single_controller.modes import (
    Dispatch,
    Execute,
    MeshDispatch,
    MeshLayout,
    Registration,
    UnsupportedDispatch,
)
from verl_balance.single_controller.rendezvous_port import free_rendezvous_port
from verl_balance.single_controller.resource_pool import RayResourcePool, check_device_name
from verl_balance.single_controller.worker import NUM_THREADS_ENV
from verl_balance.single_controller.worker_factory import installed_worker_factory

logger = logging.getLogger(__name__)

__all__ = [
    "GroupMethod",
    "RayClassWithInitArgs",
    "RayWorkerGroup",
    "GroupFuture",
    "WorkerDiedError",
    "WorkerGroupError",
    "WorkerTimeoutError",
    "declared_group_methods",
    "group_method",
]

P = ParamSpec("P")
R = TypeVar("R")

_PROTECTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", NUM_THREADS_ENV)


class WorkerDiedError(RuntimeError):
    """A worker process disappeared while running a method."""

    def __init__(self, message: str, *, rank: int, actor_id: str, method: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.actor_id = actor_id
        self.method = method


class WorkerTimeoutError(TimeoutError):
    """Worker ranks did not answer a call within the group's (or the call's) timeout."""

    def __init__(self, message: str, *, ranks: list[int], method: str, elapsed_s: float) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.method = method
        self.elapsed_s = elapsed_s


class WorkerGroupError(ValueError):
    """The worker group was configured or called incorrectly."""


class RayClassWithInitArgs:
    """A worker class (plain or ``ray.remote``) plus its constructor arguments and Ray actor options."""

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self.cls = getattr(cls, "__ray_actor_class__", cls)
        self.args = args
        self.kwargs = kwargs
        self.options: dict[str, Any] = {}

    def update_options(self, options: dict[str, Any]) -> None:
        """Extra ``ActorClass.options(...)`` (e.g. ``max_concurrency``); placement is the group's."""
        self.options.update(options)


def _address_and_free_port() -> tuple[str, int]:
    """This process's node address and a free rendezvous port on it."""
    return ray.util.get_node_ip_address().strip("[]"), free_rendezvous_port()


_node_address_and_free_port = ray.remote(num_cpus=0)(_address_and_free_port)


def _rendezvous_address(pg: Any, *, node_id: str) -> tuple[str, int]:
    """Rank 0's node address and a free port on it (rank 0 is bundle 0 of ``pg``, on ``node_id``)."""
    if node_id == ray.get_runtime_context().get_node_id():
        return _address_and_free_port()
    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
    return ray.get(_node_address_and_free_port.options(scheduling_strategy=strategy).remote())


def _worker_place(actor: Any) -> tuple[str, int, str | None]:
    """(node id, pid, stderr log file or None) of the worker process (run inside it)."""
    try:
        stderr_path = os.readlink("/proc/self/fd/2")
    except OSError:  # not Linux, or no stderr
        stderr_path = None
    if stderr_path is not None and not os.path.isfile(stderr_path):
        stderr_path = None  # a terminal or a pipe
    return ray.get_runtime_context().get_node_id(), os.getpid(), stderr_path


def _last_log_lines(path: str, *, max_lines: int = 25, max_bytes: int = 8000) -> str:
    """The last informative lines of a dead worker's stderr file, '' if unreadable."""
    try:
        with open(path, "rb") as log:
            start = max(0, log.seek(0, os.SEEK_END) - max_bytes)
            log.seek(start)
            lines = log.read().decode("utf-8", "replace").splitlines()[1 if start else 0 :]  # a cut first line
    except OSError:
        return ""
    lines = [line[:300] for line in lines if line.strip() and not line.startswith((":", "Extension modules:"))]
    return "\n".join(lines[-max_lines:])


class GroupFuture:
    """Pending result of a non-blocking group call; ``get()`` waits, checks failures, collects."""

    def __init__(
        self, group: RayWorkerGroup, method: str, refs: list, ranks: list[int], finish: Callable[[list], Any]
    ) -> None:
        self._group, self._method, self._refs, self._ranks, self._finish = group, method, refs, ranks, finish

    def get(self, timeout_s: float | None = None) -> Any:
        """The collected result; raises ``WorkerDiedError`` as soon as one worker is gone."""
        return self._finish(self._group._wait(self._method, self._refs, self._ranks, timeout_s=timeout_s))


class BoundGroupMethod(Generic[P, R]):
    """A group method bound to one group; ``submit`` returns a ``GroupFuture``."""

    def __init__(
        self,
        group: RayWorkerGroup,
        name: str,
        registration: Registration,
        doc: str | None,
        signature: inspect.Signature | None = None,
    ) -> None:
        self._group, self._name, self._registration, self._signature = group, name, registration, signature
        self.__name__ = name
        self.__doc__ = doc

    def _check_arguments(self, args: tuple, kwargs: dict) -> None:
        # a declared method's signature catches a wrong call on the driver, before any dispatch
        if self._signature is not None:
            try:
                self._signature.bind(self._group, *args, **kwargs)
            except TypeError as error:
                raise TypeError(f"{type(self._group).__name__}.{self._name}: {error}") from None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        self._check_arguments(args, kwargs)
        future = self._group._call(self._name, self._registration, args, kwargs)
        return future.get() if self._registration.blocking else future

    def submit(self, *args: P.args, **kwargs: P.kwargs) -> GroupFuture:
        """Start the call on every worker and return a future at once; ``.get()`` collects. Calls
        reach every rank in submission order."""
        self._check_arguments(args, kwargs)
        return self._group._call(self._name, self._registration, args, kwargs)

    def __repr__(self) -> str:
        r = self._registration
        return f"<group method {self._name} dispatch={r.dispatch_mode} execute={r.execute_mode.name}>"


class GroupMethod(Generic[P, R]):
    """A driver-side method declared on a worker-group class with ``@group_method``.

    The decorated function is the declaration (name, checked signature, docs); its body is never run.
    """

    def __init__(self, declaration: Callable[Concatenate[Any, P], R]) -> None:
        self.declaration = declaration
        self.name = declaration.__name__
        self.__doc__ = declaration.__doc__
        self.__wrapped__ = declaration

    @overload
    def __get__(self, group: None, owner: type | None = None) -> GroupMethod[P, R]: ...

    @overload
    def __get__(self, group: RayWorkerGroup, owner: type | None = None) -> BoundGroupMethod[P, R]: ...

    def __get__(self, group: RayWorkerGroup | None, owner: type | None = None) -> Any:
        if group is None:
            return self
        signature = inspect.signature(self.declaration)
        return BoundGroupMethod(group, self.name, group._registrations[self.name], self.__doc__, signature)


def group_method(declaration: Callable[Concatenate[Any, P], R]) -> GroupMethod[P, R]:
    """Declare a registered worker method on a worker-group class (see ``GroupMethod``)."""
    return GroupMethod(declaration)


def declared_group_methods(cls: type) -> dict[str, GroupMethod]:
    """The ``@group_method`` declarations of a group class and its bases, by name."""
    return {
        name: value
        for klass in reversed(cls.__mro__)
        for name, value in vars(klass).items()
        if isinstance(value, GroupMethod)
    }


def _checked_worker_env(
    resource_pool: Any, ray_cls_with_init: Any, worker_env: dict[str, str] | None
) -> dict[str, str]:
    """The group's arguments checked before anything starts; the worker environment as a new dict."""
    if not isinstance(resource_pool, RayResourcePool):
        raise WorkerGroupError(
            f"resource_pool must be verl_balance's RayResourcePool, "
            f"got {type(resource_pool).__module__}.{type(resource_pool).__name__}"
        )
    if not isinstance(ray_cls_with_init, RayClassWithInitArgs):
        raise WorkerGroupError(
            f"ray_cls_with_init must be a RayClassWithInitArgs, got {type(ray_cls_with_init).__name__}"
        )
    worker_env = dict(worker_env or {})
    clash = sorted(set(worker_env) & set(_PROTECTED_ENV))
    if clash:
        raise WorkerGroupError(f"worker_env may not set {clash}: the group sets them for the rendezvous")
    return worker_env


def cpu_thread_env(pool: RayResourcePool) -> dict[str, str]:
    """The driver's ``OMP_WAIT_POLICY`` for CPU workers (also on a remote cluster), else nothing.

    A node's CPU workers never hold more threads than its cores (``threads_per_worker``), so
    OpenMP's default wait (a bounded spin, then sleep) applies; on a host shared with other jobs a
    passive wait spends less CPU (docs/performance.md, "Threads")."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    if pool.use_gpu or not policy:
        return {}
    return {"OMP_WAIT_POLICY": policy}


def _rendezvous_env(pool: RayResourcePool, *, rank: int, local_rank: int, address: tuple[str, int]) -> dict[str, str]:
    """The torchrun-style variables of one worker (``worker.Worker`` reads them)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(pool.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(pool.n_gpus_per_node),
        "MASTER_ADDR": str(address[0]),
        "MASTER_PORT": str(address[1]),
        NUM_THREADS_ENV: pool.threads_per_worker,
        # read by libgomp at start-up; the Worker then sizes torch's pool to NUM_THREADS_ENV
        "OMP_NUM_THREADS": pool.threads_per_worker if pool.threads_per_worker.isdigit() else "1",
    }


def _unchanged(output: Any) -> Any:
    return output


def _process_state(pid: int) -> str:
    """'stopped', 'running', 'sleeping', 'zombie', ... of a local process ('gone' if it exited)."""
    try:
        import psutil
    except ImportError:  # ray[default] brings psutil; a minimal Ray may not
        return ""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


class RayWorkerGroup:
    """One Ray actor per bundle of ``resource_pool``, rank = bundle order (node-major).

    Args:
        resource_pool: where the workers go (placed here if not placed yet).
        ray_cls_with_init: the worker class (plain or ``ray.remote``) and its constructor arguments.
        name_prefix: prefix of the actor names (default: random).
        device_name: "cuda" / "cpu" (None: from the pool); "cpu" with GPU bundles is an error.
        worker_env: extra environment variables (may not override the rendezvous variables).
        ready_timeout_s: wait for all constructors (None: 300 s).
        failure_grace_s: after a worker raises, how long to look for a dead peer that caused it.
        call_timeout_s: per-call limit before ``WorkerTimeoutError`` (None: no limit).
        heartbeat_s: interval of the "still waiting" lines (None or 0: none).
        timeout_hint: text appended to a timeout error.

    Methods declared with ``@group_method`` are typed; every other registered worker method is bound
    by name.
    """

    def __init__(
        self,
        resource_pool: RayResourcePool,
        ray_cls_with_init: RayClassWithInitArgs,
        *,
        name_prefix: str | None = None,
        device_name: str | None = None,
        worker_env: dict[str, str] | None = None,
        ready_timeout_s: float | None = None,
        failure_grace_s: float = 5.0,
        call_timeout_s: float | None = None,
        heartbeat_s: float | None = None,
        timeout_hint: str = "",
    ) -> None:
        worker_env = _checked_worker_env(resource_pool, ray_cls_with_init, worker_env)
        self.resource_pool = resource_pool
        self.ray_cls_with_init = ray_cls_with_init
        self.name_prefix = name_prefix or f"vb_{uuid.uuid4().hex[:6]}"
        self._mesh_layouts: dict[str, MeshLayout] = {}
        self._workers: list[ray.actor.ActorHandle] = []
        self._worker_names: list[str] = []
        # (node id, pid, stderr file) per rank, once the workers are ready
        self._places: list[tuple[str, int, str | None]] = []
        self._factory_starts: list = []  # workers from an installed WorkerFactory: their construction refs
        self._factory = None  # the WorkerFactory that started this group's workers (worker_factory.py), if any
        self._failed = False  # a call failed or was interrupted: the workers are not reused
        self.failure_grace_s = failure_grace_s
        self.call_timeout_s = call_timeout_s
        self.heartbeat_s = heartbeat_s
        self.timeout_hint = timeout_hint
        self._extension = extension_for_worker_class(ray_cls_with_init.cls)
        self._bind_registered_methods(ray_cls_with_init.cls)  # before any worker starts: fails cheaply
        check_device_name(device_name, use_gpu=resource_pool.use_gpu)
        self.device_name = device_name or ("cuda" if resource_pool.use_gpu else "cpu")
        self._start_workers(worker_env)
        try:
            self._wait_until_ready(300.0 if ready_timeout_s is None else ready_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ start-up
    def _start_workers(self, worker_env: dict[str, str]) -> None:
        """One actor per bundle, rank = bundle order, with the rendezvous in its environment."""
        pool = self.resource_pool
        pgs = pool.get_placement_groups()
        master_addr, master_port = _rendezvous_address(pgs[0], node_id=pool.node_ids()[0])
        if self._extension is not None:
            worker_env = {
                **worker_env,
                **self._extension.worker_env(name_prefix=self.name_prefix, local_world_size=pool.n_gpus_per_node),
            }
        init = self.ray_cls_with_init
        factory = installed_worker_factory()
        if factory is not None and factory.accepts(
            init.cls, use_gpu=pool.use_gpu, has_extension=self._extension is not None
        ):
            self._factory = factory
        actor_cls = None if self._factory is not None else ray.remote(init.cls)
        for pg_index, pg in enumerate(pgs):
            for local_rank in range(pool.n_gpus_per_node):
                rank = len(self._workers)
                env = {
                    **cpu_thread_env(pool),
                    **worker_env,
                    **_rendezvous_env(pool, rank=rank, local_rank=local_rank, address=(master_addr, master_port)),
                }
                name = f"{self.name_prefix}_{init.cls.__name__}_{pg_index}:{local_rank}"
                options = self._actor_options(pg, local_rank=local_rank, env=env, name=name)
                self._workers.append(self._new_worker(actor_cls, options))
                self._worker_names.append(name)

    def _new_worker(self, actor_cls: Any, options: dict[str, Any]) -> Any:
        """A new actor, or a worker of the installed ``WorkerFactory`` (``worker_factory.py``)."""
        init = self.ray_cls_with_init
        if self._factory is None:
            return actor_cls.options(**options).remote(*init.args, **init.kwargs)
        handle, start = self._factory.start_worker(init.cls, options=options, args=init.args, kwargs=init.kwargs)
        self._factory_starts.append(start)
        return handle

    def _actor_options(self, pg: Any, *, local_rank: int, env: dict[str, str], name: str) -> dict[str, Any]:
        """Ray actor options of one worker: its bundle, its share of the bundle, its environment."""
        pool, init = self.resource_pool, self.ray_cls_with_init
        runtime_env = dict(init.options.get("runtime_env", {}))
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env}
        return {
            **init.options,
            "num_cpus": pool.cpus_per_worker,
            "num_gpus": 1 / pool.max_colocate_count if pool.use_gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=local_rank
            ),
            "runtime_env": runtime_env,
            "name": name,
        }

    def _wait_until_ready(self, timeout_s: float) -> None:
        # the first task after each constructor: it proves the worker ready and tells where it runs
        if self._factory_starts:
            self._wait("__init__", self._factory_starts, list(range(self.world_size)), timeout_s=timeout_s)
        places = [w.__ray_call__.remote(_worker_place) for w in self._workers]
        self._places = self._wait("__init__", places, list(range(self.world_size)), timeout_s=timeout_s)

    # ------------------------------------------------------------------ properties
    @property
    def world_size(self) -> int:
        """Number of workers."""
        return len(self._workers)

    @property
    def workers(self) -> list[ray.actor.ActorHandle]:
        """Actor handles in rank order."""
        return list(self._workers)

    @property
    def worker_names(self) -> list[str]:
        """Ray actor names in rank order."""
        return list(self._worker_names)

    # ------------------------------------------------------------------ binding
    def _bind_registered_methods(self, cls: type) -> None:
        """Check the declared group methods against ``cls`` and bind its other registered methods."""
        declared = declared_group_methods(type(self))
        self._registrations: dict[str, Registration] = {}
        for name in dir(cls):
            registration = get_registration(getattr(cls, name, None), name=f"{cls.__name__}.{name}")
            if registration is None:
                continue
            self._registrations[name] = registration
            if isinstance(registration.dispatch_mode, UnsupportedDispatch):
                logger.warning("%s: calling it from the group will raise: %s", name, registration.dispatch_mode.reason)
            if name in declared:
                continue
            if hasattr(type(self), name) or name in self.__dict__:
                raise WorkerGroupError(
                    f"registered method {cls.__name__}.{name} clashes with a {type(self).__name__} attribute; rename it"
                )
            setattr(self, name, BoundGroupMethod(self, name, registration, getattr(cls, name).__doc__))
        missing = sorted(set(declared) - set(self._registrations))
        if missing:
            raise WorkerGroupError(
                f"{type(self).__name__} declares {missing} but {cls.__name__} registers no such method(s)"
            )
        if self._extension is not None and not self._registrations:
            raise WorkerGroupError(
                f"{cls.__name__} is a {self._extension.name} worker but no registered method could be bound"
            )
        self.method_names = sorted(self._registrations)

    # ------------------------------------------------------------------ execution
    def mesh_layout(self, mesh_name: str) -> MeshLayout:
        """The validated DP routing table the workers registered for ``mesh_name`` (cached)."""
        if mesh_name not in self._mesh_layouts:
            if self._extension is not None:
                infos = self._extension.mesh_infos(self, mesh_name)
            else:
                infos = self.execute_all("_query_mesh_info", mesh_name)
            self._mesh_layouts[mesh_name] = MeshLayout.from_worker_infos(mesh_name, infos)
        return self._mesh_layouts[mesh_name]

    def _call(self, method: str, registration: Registration, args: tuple, kwargs: dict) -> GroupFuture:
        # a pending non-blocking result passed on (verl's drivers pass futures this way) is awaited here
        args = tuple(a.get() if isinstance(a, GroupFuture) else a for a in args)
        kwargs = {k: v.get() if isinstance(v, GroupFuture) else v for k, v in kwargs.items()}
        mode = registration.dispatch_mode
        mesh = self.mesh_layout(mode.mesh_name) if isinstance(mode, MeshDispatch) else None
        remove_padding: Callable[[Any], Any] = _unchanged
        if mode in (Dispatch.DP_COMPUTE_PROTO, Dispatch.DP_COMPUTE_METRIC):
            args, kwargs, remove_padding = pad_for_even_split(args, kwargs, self.world_size)
        calls = dispatch_args(mode, args, kwargs, world_size=self.world_size, mesh=mesh)
        if registration.execute_mode is Execute.RANK_ZERO:
            refs = self._submit(method, calls[:1])
            return GroupFuture(self, method, refs, [0], lambda outputs: outputs[0])
        refs = self._submit(method, calls)

        def finish(outputs: list) -> Any:
            return remove_padding(collect_outputs(mode, outputs, mesh=mesh))

        return GroupFuture(self, method, refs, list(range(self.world_size)), finish)

    def _submit(self, method: str, calls: list[tuple[tuple, dict]]) -> list:
        # A Batch handed to several workers (SP replicas, ONE_TO_ALL) is put in the object store once.
        # One handed to a single worker goes as a plain argument: Ray sends it inline up to
        # max_direct_call_object_size (ray_start.INLINE_ARGUMENT_BYTES on an embedded cluster) and
        # stores it itself above that, either way without the round trip of an explicit ray.put.
        uses = Counter(id(v) for args, kwargs in calls for v in (*args, *kwargs.values()) if isinstance(v, Batch))
        stored: dict[int, Any] = {}

        def store_shared(value: Any) -> Any:
            if not isinstance(value, Batch) or uses[id(value)] < 2:
                return value
            if id(value) not in stored:
                stored[id(value)] = ray.put(value)
            return stored[id(value)]

        refs = []
        for worker, (args, kwargs) in zip(self._workers, calls):
            remote_method = getattr(worker, method)
            refs.append(
                remote_method.remote(*map(store_shared, args), **{k: store_shared(v) for k, v in kwargs.items()})
            )
        return refs

    def _wait(self, method: str, refs: list, ranks: list[int], *, timeout_s: float | None = None) -> list:
        try:
            return self._wait_outputs(method, refs, ranks, timeout_s=timeout_s)
        except BaseException:
            self._failed = True
            raise

    def _wait_outputs(self, method: str, refs: list, ranks: list[int], *, timeout_s: float | None) -> list:
        position = {ref: i for i, ref in enumerate(refs)}
        outputs: list[Any] = [None] * len(refs)
        pending = list(refs)
        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s
        beat = self.heartbeat_s or None
        next_beat = None if beat is None else start + beat
        while pending:
            now = time.monotonic()
            limits = [t - now for t in (deadline, next_beat) if t is not None]
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(limits)) if limits else None)
            if not ready:
                waiting = sorted(ranks[position[ref]] for ref in pending)
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise self._timeout_error(method, waiting, elapsed_s=now - start, timeout_s=timeout_s)
                if next_beat is not None and now >= next_beat:
                    self._heartbeat(method, waiting, answered=len(refs) - len(pending), elapsed_s=now - start)
                    next_beat = now + beat
                continue
            for ref in ready:
                i = position[ref]
                try:
                    outputs[i] = ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    raise self._died_error(method, ranks[i], error) from error
                except ray.exceptions.RayTaskError as error:
                    # A peer that died mid-collective often surfaces first as a connection error on the
                    # survivors; report the dead worker (the cause) if one shows up within the grace period.
                    died = self._find_death(method, {r: ranks[position[r]] for r in pending}, self.failure_grace_s)
                    if died is not None:
                        died.add_note(f"worker rank {ranks[i]} raised meanwhile: {type(error).__name__}")
                        raise died from error
                    error.add_note(
                        f"raised by worker rank {ranks[i]} ({self._worker_names[ranks[i]]}) "
                        f"in {self._describe_method(method)}"
                    )
                    raise
        return outputs

    def _heartbeat(self, method: str, waiting: list[int], *, answered: int, elapsed_s: float) -> None:
        # Some ranks done and others not is how a stopped or stuck worker looks: a warning.
        level = logging.WARNING if answered else logging.INFO
        logger.log(
            level,
            "still waiting for %s after %.0f s: worker rank(s) %s have not answered (%s); %d rank(s) answered",
            self._describe_method(method),
            elapsed_s,
            waiting,
            self._describe_ranks(waiting),
            answered,
        )

    def _describe_ranks(self, ranks: list[int]) -> str:
        """Name, pid and process state (driver's node only) of each rank."""
        here = ray.get_runtime_context().get_node_id()
        parts = []
        for rank in ranks:
            if rank >= len(self._worker_names):
                continue
            text = self._worker_names[rank]
            if rank < len(self._places):
                node, pid, _ = self._places[rank]
                text += f" pid {pid}" + (f" {_process_state(pid)}" if node == here else "")
            parts.append(text)
        return ", ".join(parts)

    def _timeout_error(self, method: str, waiting: list[int], *, elapsed_s: float, timeout_s: float) -> Exception:
        hint = f"; {self.timeout_hint}" if self.timeout_hint else ""
        return WorkerTimeoutError(
            f"{self._describe_method(method)}: worker rank(s) {waiting} did not finish within {timeout_s:g} s "
            f"(waited {elapsed_s:.1f} s for {self._describe_ranks(waiting)}): stopped, deadlocked or starved; "
            f"the group is unusable, call shutdown(){hint}",
            ranks=waiting,
            method=method,
            elapsed_s=elapsed_s,
        )

    def _find_death(self, method: str, rank_of: dict, grace_s: float) -> WorkerDiedError | None:
        deadline = time.monotonic() + grace_s
        pending = list(rank_of)
        while pending and time.monotonic() < deadline:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as error:
                    return self._died_error(method, rank_of[ref], error)
                except Exception:  # noqa: BLE001 - other ranks' errors are secondary here
                    pass
        return None

    def _died_error(self, method: str, rank: int, error: Exception) -> WorkerDiedError:
        actor_id = self._workers[rank]._actor_id.hex()
        reason = " ".join(str(error).split())[:600]
        pid = f", pid {self._places[rank][1]}" if rank < len(self._places) else ""
        return WorkerDiedError(
            f"worker rank {rank} (actor {actor_id}, name {self._worker_names[rank]}{pid}) died during "
            f"{self._describe_method(method)}; the group is unusable, call shutdown(). Ray says: {reason}"
            f"{self._last_words(rank)}",
            rank=rank,
            actor_id=actor_id,
            method=method,
        )

    def _last_words(self, rank: int) -> str:
        """The dead rank's last stderr lines when its log is on the driver's node (else where it is)."""
        if rank >= len(self._places) or self._places[rank][2] is None:
            return ""
        node, _, path = self._places[rank]
        if node != ray.get_runtime_context().get_node_id():
            return f"\nits stderr is {path} on node {node}"
        tail = _last_log_lines(path)
        return f"\nthe last lines of its stderr ({path}):\n{tail}" if tail else ""

    def _describe_method(self, method: str) -> str:
        return f"{self.ray_cls_with_init.cls.__name__}.{method}"

    def execute_all_async(self, method: str, *args: Any, **kwargs: Any) -> GroupFuture:
        """Call ``method`` with the same arguments on every worker; ``.get()`` gives the W outputs."""
        refs = self._submit(method, [(args, kwargs)] * self.world_size)
        return GroupFuture(self, method, refs, list(range(self.world_size)), lambda outputs: outputs)

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Call ``method`` with the same arguments on every worker and return the outputs in rank order."""
        return self.execute_all_async(method, *args, **kwargs).get()

    def execute_rank_zero(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on rank 0 only and return its output."""
        return GroupFuture(self, method, self._submit(method, [(args, kwargs)]), [0], lambda outputs: outputs[0]).get()

    def shutdown(self) -> None:
        """Kill the workers (or hand them back to their ``WorkerFactory``); the pool stays reserved."""
        if self._factory is not None:
            self._factory.release(self._workers, clean=not self._failed)
        else:
            for worker in self._workers:
                ray.kill(worker, no_restart=True)
        self._workers = []
        self._worker_names = []
        self._places = []
        self._mesh_layouts = {}
