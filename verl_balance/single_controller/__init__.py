"""Ray worker groups driven by one controller (the trainer), verl-style.

Ray-free (importable by worker classes and tests without Ray): ``Worker``, ``register``,
``Dispatch``, ``Execute``, ``make_mesh_dispatch``. The Ray-backed classes (``RayResourcePool``,
``RayClassWithInitArgs``, ``RayWorkerGroup``, ``WorkerDiedError``, ...) are imported on first
access, so ``import verl_balance.single_controller`` alone does not import Ray.

verl-style code runs unchanged: ``RayResourcePool([2], use_gpu=False)``, ``RayWorkerGroup(pool,
RayClassWithInitArgs(cls=ray.remote(MyWorker)), device_name="cpu")``, workers subclassing verl's
``Worker`` with verl's ``register`` / ``Dispatch`` / ``make_nd_compute_dataproto_dispatch_fn``, and
verl ``DataProto`` arguments (see ``verl_compat``). verl stays optional and is never imported here.
"""

from __future__ import annotations

import importlib
from typing import Any

from verl_balance.single_controller.decorator import (
    Dispatch,
    DispatchError,
    Execute,
    MeshDispatch,
    MeshInfo,
    MeshLayout,
    MeshLayoutError,
    make_mesh_dispatch,
    register,
)
from verl_balance.single_controller.worker import Worker

_RAY_EXPORTS = {
    "RayResourcePool": "resource_pool",
    "UnplaceableResourcePoolError": "resource_pool",
    "RayClassWithInitArgs": "worker_group",
    "RayWorkerGroup": "worker_group",
    "GroupFuture": "worker_group",
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
