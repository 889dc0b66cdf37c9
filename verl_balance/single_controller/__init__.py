"""Ray worker groups driven by one controller (the trainer), verl-style.

Ray-free (importable by worker classes and tests without Ray): ``Worker``, ``register``,
``Dispatch``, ``Execute``, ``make_mesh_dispatch``. The Ray-backed classes (``RayResourcePool``,
``RayClassWithInitArgs``, ``RayWorkerGroup``, ``WorkerDiedError``, ...) and the Ray-free ones alike
are imported on first access, so ``import verl_balance.single_controller`` alone (or with a submodule
such as ``forked_workers``) imports neither Ray nor torch.

The shape is verl's (``RayResourcePool([2], use_gpu=False)``, ``RayWorkerGroup(pool,
RayClassWithInitArgs(cls=ray.remote(MyWorker)), device_name="cpu")``, ``@register``), but this
package knows no framework: another framework's workers, modes and row containers plug in through
``extensions`` (``ControllerExtension``, ``register_row_container``). verl's are installed by
importing ``verl_balance.integrations.verl``, whose ``RayWorkerGroup`` also takes verl's constructor.
"""

from __future__ import annotations

import importlib
from typing import Any

_RAY_FREE_EXPORTS = {
    "register": "decorator",
    "Dispatch": "modes",
    "DispatchError": "modes",
    "Execute": "modes",
    "MeshDispatch": "modes",
    "MeshInfo": "modes",
    "MeshLayout": "modes",
    "MeshLayoutError": "modes",
    "make_mesh_dispatch": "modes",
    "Worker": "worker",
}
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

__all__ = [*_RAY_FREE_EXPORTS, *_RAY_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _RAY_FREE_EXPORTS.get(name) or _RAY_EXPORTS.get(name)
    if module is not None:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
