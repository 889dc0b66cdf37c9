"""verl-facing adapters (optional ``verl`` extra); this facade keeps the public names in one place.

Modules (imports point one way: errors/state/workload <- seqlen <- trainer_balance <- patch;
convert, loss stand alone; worker uses convert, seqlen, trainer_balance):

- ``seqlen``: drop-ins for ``verl.utils.seqlen_balancing`` (``get_seqlen_balanced_partitions``,
  ``rearrange_micro_batches``, ``get_reverse_idx``);
- ``trainer_balance``: ``balance_batch`` and the replacements of verl's trainers' ``_balance_batch``;
- ``patch``: ``patch_verl()`` swaps the above into verl (``autopatch`` does it on import, for
  ``VERL_USE_EXTERNAL_MODULES``);
- ``workload``: workload models (``VerlWorkload``, FLOPs from a Hugging Face config, the
  ``VERL_BALANCE_WORKLOAD`` default);
- ``convert``: ``DataProto``/TensorDict <-> ``Batch``;
- ``loss``: ``loss_counts`` + ``agg_loss``, our loss contract for verl-shaped loss matrices;
- ``worker``: ``VerlActorWorker``, our actor as a verl ``Worker`` (imported lazily: it needs verl);
- ``controller``: verl's modes, ``register`` marks, ``Worker`` classes and ``DataProto`` /
  ``TensorDict`` rows on our single controller (a ``ControllerExtension`` plus row containers);
- ``worker_group``: ``RayWorkerGroup`` with verl's constructor and ``execute_*_sync`` names
  (imported lazily: it imports Ray).

Importing this package never imports verl; functions that need verl import it when called and
raise ``VerlNotInstalledError`` (an ImportError naming the ``verl`` extra) when it is missing.
Importing it installs the ``controller`` registrations, so every process that loads any part of
the integration (the engine backend verl's trainers select, ``autopatch``) dispatches verl's
objects on our worker groups.
"""

from __future__ import annotations

from verl_balance.integrations.verl.controller import install as _install_controller_extension
from verl_balance.integrations.verl.convert import batch_from_dataproto, batch_from_tensordict, batch_to_dataproto
from verl_balance.integrations.verl.errors import INSTALL_HINT, VerlNotInstalledError, require_verl
from verl_balance.integrations.verl.loss import LossCounts, agg_loss, loss_counts
from verl_balance.integrations.verl.patch import VerlPatch, patch_verl
from verl_balance.integrations.verl.seqlen import (
    get_reverse_idx,
    get_seqlen_balanced_partitions,
    rearrange_micro_batches,
)
from verl_balance.integrations.verl.trainer_balance import balance_batch
from verl_balance.integrations.verl.workload import VerlWorkload, workload_from_hf_config, workload_of_actor

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
        from verl_balance.integrations.verl.worker_group import RayWorkerGroup

        return RayWorkerGroup
    # VerlActorWorker subclasses verl's Worker, so it can only be defined once verl is imported.
    if name == "VerlActorWorker":
        require_verl()
        from verl_balance.integrations.verl.worker import VerlActorWorker

        return VerlActorWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
