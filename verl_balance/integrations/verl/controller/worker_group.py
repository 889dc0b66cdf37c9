"""verl's ``RayWorkerGroup`` constructor and method names on our worker group.

``RayWorkerGroup(resource_pool, ray_cls_with_init, bin_pack, name_prefix, detached, worker_names,
worker_handles, ray_wait_register_center_timeout, *, device_name=...)`` takes verl's
constructor (positional or keyword, as verl's trainers call it) and builds our
``single_controller.RayWorkerGroup``: ``ray_wait_register_center_timeout`` is our
``ready_timeout_s``, verl's ``RayClassWithInitArgs`` is taken over with its class, arguments and
actor options, and ``execute_all_sync`` / ``execute_rank_zero_sync`` behave as verl's. What we
cannot honour (``bin_pack=False``, ``detached=True``, attaching to existing workers) is refused
before anything starts. One difference: verl's ``execute_all`` is asynchronous (returns object
refs); ours returns the results.

A worker class subclassing verl's ``Worker`` gets the environment verl's group sets and its
methods marked by verl's ``register`` bound with the translated modes: that is the verl
``ControllerExtension`` (``controller/extension.py``), installed by importing this package, so our plain
``single_controller.RayWorkerGroup`` drives verl workers too.
"""

from __future__ import annotations

from typing import Any

from verl_balance.integrations.verl.compat import class_options
from verl_balance.integrations.verl.controller.extension import install
from verl_balance.single_controller import worker_group as core
from verl_balance.single_controller.modes import Dispatch
from verl_balance.single_controller.resource_pool import RayResourcePool
from verl_balance.single_controller.worker_group import GroupFuture, RayClassWithInitArgs, WorkerGroupError

__all__ = ["RayClassWithInitArgs", "RayResourcePool", "RayWorkerGroup", "class_with_init_args"]

DEFAULT_READY_TIMEOUT_S = 300.0


def class_with_init_args(value: Any) -> RayClassWithInitArgs:
    """Ours unchanged; verl's ``RayClassWithInitArgs`` (cls, args, kwargs, _options) converted."""
    if isinstance(value, RayClassWithInitArgs):
        return value
    if all(hasattr(value, a) for a in ("cls", "args", "kwargs")):
        ours = RayClassWithInitArgs(value.cls, *value.args, **value.kwargs)
        ours.update_options(class_options(value))
        return ours
    raise WorkerGroupError(f"ray_cls_with_init must be a RayClassWithInitArgs, got {type(value).__name__}")


def _refuse_unsupported(
    resource_pool: Any,
    ray_cls_with_init: Any,
    *,
    bin_pack: bool,
    detached: bool,
    worker_names: Any,
    worker_handles: Any,
) -> None:
    """verl's options this group cannot honour, refused before anything is placed or started."""
    if resource_pool is None or ray_cls_with_init is None or worker_names is not None or worker_handles is not None:
        raise WorkerGroupError(
            "RayWorkerGroup needs resource_pool and ray_cls_with_init; attaching to existing (detached) workers "
            "via worker_names/worker_handles is not supported"
        )
    if not bin_pack:
        raise WorkerGroupError(
            "bin_pack=False is not supported: each node's workers form one STRICT_PACK placement group"
        )
    if detached:
        raise WorkerGroupError("detached=True is not supported: the workers live as long as the driver")


def _ready_timeout(ray_wait_register_center_timeout: float | None, ready_timeout_s: float | None) -> float:
    if ray_wait_register_center_timeout is not None and ready_timeout_s is not None:
        raise WorkerGroupError("give ready_timeout_s or verl's ray_wait_register_center_timeout, not both")
    if ready_timeout_s is not None:
        return ready_timeout_s
    if ray_wait_register_center_timeout is not None:
        return float(ray_wait_register_center_timeout)
    return DEFAULT_READY_TIMEOUT_S


class RayWorkerGroup(core.RayWorkerGroup):
    """Our worker group behind verl's constructor and verl's ``execute_*_sync`` names (module doc).

    Keyword-only arguments after verl's positional ones are our group's (``device_name``,
    ``worker_env``, ``ready_timeout_s``, ``call_timeout_s``, ...).
    """

    def __init__(
        self,
        resource_pool: RayResourcePool | None = None,
        ray_cls_with_init: Any = None,
        bin_pack: bool = True,
        name_prefix: str | None = None,
        detached: bool = False,
        worker_names: list[str] | None = None,
        worker_handles: list | None = None,
        ray_wait_register_center_timeout: float | None = None,
        *,
        ready_timeout_s: float | None = None,
        **options: Any,
    ) -> None:
        install()
        _refuse_unsupported(
            resource_pool,
            ray_cls_with_init,
            bin_pack=bin_pack,
            detached=detached,
            worker_names=worker_names,
            worker_handles=worker_handles,
        )
        super().__init__(
            resource_pool,
            class_with_init_args(ray_cls_with_init),
            name_prefix=name_prefix,
            ready_timeout_s=_ready_timeout(ray_wait_register_center_timeout, ready_timeout_s),
            **options,
        )

    def execute_all_sync(self, method: str, *args: Any, **kwargs: Any) -> list:
        """verl's ``execute_all_sync``: if every argument is a list of ``world_size`` items, rank i gets
        item i; otherwise every rank gets the same arguments. Returns the outputs in rank order."""
        values = [*args, *kwargs.values()]
        if values and all(isinstance(v, list) and len(v) == self.world_size for v in values):
            calls = core.dispatch_args(Dispatch.ALL_TO_ALL, args, kwargs, world_size=self.world_size)
            refs = self._submit(method, calls)
            return GroupFuture(self, method, refs, list(range(self.world_size)), lambda outputs: outputs).get()
        return self.execute_all(method, *args, **kwargs)

    def execute_rank_zero_sync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """verl's name for ``execute_rank_zero``."""
        return self.execute_rank_zero(method, *args, **kwargs)
