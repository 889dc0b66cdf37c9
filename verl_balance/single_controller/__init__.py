"""Ray worker groups driven by one controller (the trainer), verl-style.

Ray-free (importable by worker classes and tests without Ray): ``Worker``, ``register``,
``Dispatch``, ``Execute``, ``make_mesh_dispatch``. The Ray-backed classes (``RayResourcePool``,
``RayClassWithInitArgs``, ``RayWorkerGroup``, ``WorkerDiedError``, ...) are imported on first
access, so ``import verl_balance.single_controller`` alone does not import Ray.

The shape is verl's (``RayResourcePool([2], use_gpu=False)``, ``RayWorkerGroup(pool,
RayClassWithInitArgs(cls=ray.remote(MyWorker)), device_name="cpu")``, ``@register``), but this
package knows no framework: another framework's workers, modes and row containers plug in through
``extensions`` (``ControllerExtension``, ``register_row_container``). verl's are installed by
importing ``verl_balance.integrations.verl``, whose ``RayWorkerGroup`` also takes verl's constructor.
"""

from __future__ import annotations

import importlib
from typing import Any

from verl_balance.single_controller.decorator import register
from verl_balance.single_controller.modes import (
    Dispatch,
    DispatchError,
    Execute,
    MeshDispatch,
    MeshInfo,
    MeshLayout,
    MeshLayoutError,
    make_mesh_dispatch,
)
from verl_balance.single_controller.worker import Worker

_RAY_EXPORTS = {
    "RayResourcePool": "resource_pool",
    "UnplaceableResourcePoolError": "resource_pool",
    "RayClassWithInitArgs": "worker_group",
    "RayWorkerGroup": "worker_group",
    "GroupFuture": "worker_group",
    "GroupMethod": "worker_group",
    "group_method": "worker_group",
    "WorkerDiedError": "worker_group",
    "WorkerTimeoutError": "worker_group",
    "WorkerGroupError": "worker_group",
}

__all__ = [
    "Dispatch",
    "DispatchError",
    "Execute",
    "MeshDispatch",
    "MeshInfo",
    "MeshLayout",
    "MeshLayoutError",
    "Worker",
    "make_mesh_dispatch",
    "register",
    *_RAY_EXPORTS,
]


def __getattr__(name: str) -> Any:
    if name in _RAY_EXPORTS:
        module = importlib.import_module(f"{__name__}.{_RAY_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
