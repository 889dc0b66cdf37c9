"""verl-facing adapters (optional ``verl`` extra); this facade keeps the public names in one place.

Sub-packages by concern (imports point one way: ``errors`` <- ``patches`` <- ``controller``; the
entry points ``engine`` and ``autopatch`` sit on top):

- ``engine``: ``verl_balance`` as a verl training-engine backend (``strategy=verl_balance``), with its
  checkpoint record, HF export files and per-tensor shards in ``backend/``;
- ``patches/``: our balancer inside verl's modules: drop-ins for ``verl.utils.seqlen_balancing``
  (``seqlen``), ``balance_batch`` and the trainers' ``_balance_batch`` (``trainer_balance``),
  ``patch_verl()`` (``patch``; ``autopatch`` applies it on import, for ``VERL_USE_EXTERNAL_MODULES``),
  workload models (``workload``) and the reward-key spelling;
- ``controller/``: verl's modes, ``register`` marks, ``Worker`` classes and row containers on our
  single controller (``extension``), ``RayWorkerGroup`` with verl's constructor (``worker_group``),
  ``VerlActorWorker`` (``worker``);
- ``cpu_shims/``: a CPU platform and a CPU rollout server so verl's own trainers run without a GPU
  (CI, laptops; loaded through ``VERL_USE_EXTERNAL_MODULES``);
- ``convert``: ``DataProto``/TensorDict <-> ``Batch``; ``loss``: ``loss_counts`` + ``agg_loss``.

Importing this package never imports verl; functions that need verl import it when called and
raise ``VerlNotInstalledError`` (an ImportError naming the ``verl`` extra) when it is missing.
Importing it installs the ``controller`` registrations, so every process that loads any part of
the integration (the engine backend verl's trainers select, ``autopatch``) dispatches verl's
objects on our worker groups.
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
