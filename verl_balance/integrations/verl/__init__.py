"""verl-facing adapters (optional ``verl`` extra); this facade keeps the public names in one place.

Sub-packages by concern (docs/verl.md, "Layout of the package"): ``engine`` + ``backend/`` (the
``verl_balance`` training-engine backend), ``patches/`` (our balancer inside verl's modules,
``patch_verl``), ``controller/`` (verl's workers and modes on our single controller), ``cpu_shims/``
(verl's own trainers without a GPU), ``compat`` (the one version-checked gate to verl's private
names), ``convert`` and ``loss``.

Importing this package never imports verl (``VerlNotInstalledError``, naming the extra, when a
function needs it and it is missing) and installs the ``controller`` registrations, so every process
that loads any part of the integration dispatches verl's objects on our worker groups.
"""

from __future__ import annotations

from verl_balance.integrations.verl.controller.extension import install as _install_controller_extension
from verl_balance.integrations.verl.convert import batch_from_dataproto, batch_from_tensordict, batch_to_dataproto
from verl_balance.integrations.verl.errors import INSTALL_HINT, VerlNotInstalledError, require_verl
from verl_balance.integrations.verl.loss import LossCounts, agg_loss, loss_counts
from verl_balance.integrations.verl.patches.patch import VerlPatch, patch_verl
from verl_balance.integrations.verl.patches.seqlen import (
    get_reverse_idx,
    get_seqlen_balanced_partitions,
    rearrange_micro_batches,
)
from verl_balance.integrations.verl.patches.trainer_balance import balance_batch
from verl_balance.integrations.verl.patches.workload import VerlWorkload, workload_from_hf_config, workload_of_actor

__all__ = [
    "INSTALL_HINT",
    "LossCounts",
    "RayWorkerGroup",
    "VerlActorWorker",
    "VerlNotInstalledError",
    "VerlPatch",
    "VerlWorkload",
    "agg_loss",
    "balance_batch",
    "batch_from_dataproto",
    "batch_from_tensordict",
    "batch_to_dataproto",
    "get_reverse_idx",
    "get_seqlen_balanced_partitions",
    "loss_counts",
    "patch_verl",
    "rearrange_micro_batches",
    "require_verl",
    "workload_from_hf_config",
    "workload_of_actor",
]

_install_controller_extension()


def __getattr__(name: str):
    if name == "RayWorkerGroup":  # imports Ray, which this facade does not need otherwise
        from verl_balance.integrations.verl.controller.worker_group import RayWorkerGroup

        return RayWorkerGroup
    # VerlActorWorker subclasses verl's Worker, so it can only be defined once verl is imported.
    if name == "VerlActorWorker":
        require_verl()
        from verl_balance.integrations.verl.controller.worker import VerlActorWorker

        return VerlActorWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
