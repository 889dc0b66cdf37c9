"""``VerlActorWorker``: our ``ActorWorker`` as a verl ``Worker``, driven by verl's ``RayWorkerGroup``.

Invariants:
- Registered methods carry verl's names, arguments and dispatch modes; ``init_model`` registers the
  "actor" mesh (collect on SP rank 0). All SP ranks of a DP group receive the same chunk.
- Data is a ``DataProto`` in verl_balance's wire format. A chunk is split into micro-batches by the
  planned sizes (meta ``verl_balance/micro_batch_sizes``), else ``micro_batch_size_per_gpu``, else
  the token cap (count agreed over the world). ``compute_log_prob`` returns rows in input order.
"""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import torch

from verl_balance.batch_keys import (
    ATTENTION_MASK_KEY,
    ENTROPY_KEY,
    INPUT_IDS_KEY,
    LOG_PROBS_KEY,
    OLD_LOG_PROBS_KEY,
    VERL_ENTROPY_KEY,
)
from verl_balance.integrations.verl.backend.sealed_checkpoint import seal, unseal, verify_sealed
from verl_balance.integrations.verl.compat import register_dispatch_collect_info
from verl_balance.integrations.verl.convert import batch_from_dataproto, batch_to_dataproto
from verl_balance.integrations.verl.errors import require_verl
from verl_balance.integrations.verl.patches.seqlen import rearrange_micro_batches
from verl_balance.integrations.verl.patches.trainer_balance import PLANNED_SIZES_KEY

require_verl()

import torch.distributed as dist  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.single_controller.base import Worker  # noqa: E402
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register  # noqa: E402

from verl_balance.batch_keys import MICRO_BATCH_SIZES_KEY  # noqa: E402
from verl_balance.protocol import Batch  # noqa: E402
from verl_balance.workers.actor import ACTOR_MESH, ActorWorker, ActorWorkerConfig  # noqa: E402

__all__ = ["PLANNED_SIZES_KEY", "VerlActorWorker", "VerlWorkerConfigError"]

logger = logging.getLogger(__name__)


class VerlWorkerConfigError(ValueError):
    """Bad arguments to VerlActorWorker or its methods."""


class VerlActorWorker(Worker):
    """verl ``Worker`` that delegates to one rank of our ``ActorWorker`` (FSDP2 + Ulysses engine)."""

    def __init__(
        self,
        config: ActorWorkerConfig,
        *,
        micro_batch_size_per_gpu: int | None = None,
        max_token_len_per_gpu: int | None = None,
    ) -> None:
        Worker.__init__(self)
        if (micro_batch_size_per_gpu is None) == (max_token_len_per_gpu is None):
            raise VerlWorkerConfigError(
                "give exactly one of micro_batch_size_per_gpu (got "
                f"{micro_batch_size_per_gpu!r}) and max_token_len_per_gpu (got {max_token_len_per_gpu!r})"
            )
        self.micro_batch_size_per_gpu = micro_batch_size_per_gpu
        self.max_token_len_per_gpu = max_token_len_per_gpu
        self.actor = ActorWorker(config)

    # ------------------------------------------------------------------ setup
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        """Build the sharded engine and register the "actor" mesh for verl's dispatch."""
        info = self.actor.init_model()
        layout = self.actor.layout
        register_dispatch_collect_info(self, ACTOR_MESH, dp_rank=layout.dp_rank, is_collect=layout.sp_rank == 0)
        return info

    # ------------------------------------------------------------------ data
    def _planned_chunk(self, data: DataProto) -> tuple[Batch, np.ndarray]:
        """This rank's chunk in micro-batch order, and the row order applied."""
        batch = batch_from_dataproto(data)
        n = len(batch)
        planned = batch.meta.pop(PLANNED_SIZES_KEY, None)
        if planned is not None:
            sizes = [int(s) for s in planned[self.actor.layout.dp_rank]]
            if sum(sizes) != n:
                raise VerlWorkerConfigError(
                    f"meta {PLANNED_SIZES_KEY!r} plans {sum(sizes)} rows for DP rank {self.actor.layout.dp_rank} "
                    f"but its chunk has {n}; reorder with integrations.verl.balance_batch right before dispatch"
                )
            order = np.arange(n)
        elif self.micro_batch_size_per_gpu is not None:
            size = self.micro_batch_size_per_gpu
            sizes = [min(size, n - start) for start in range(0, n, size)]
            order = np.arange(n)
        else:
            tensors = batch.tensors.select(INPUT_IDS_KEY, ATTENTION_MASK_KEY)
            # Every rank of the world joins this count agreement; SP peers hold the same rows.
            _, indices = rearrange_micro_batches(
                tensors,
                self.max_token_len_per_gpu * self.actor.layout.sp,
                dp_group=dist.group.WORLD,
                use_dynamic_bsz_balance=False,
            )
            sizes = [len(idx) for idx in indices]
            order = np.asarray([i for idx in indices for i in idx], dtype=np.int64)
            batch = batch.index_select(order)
        batch.meta[MICRO_BATCH_SIZES_KEY] = sizes
        return batch, order

    # ------------------------------------------------------------------ compute
    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name=ACTOR_MESH))
    def update_actor(self, data: DataProto) -> DataProto:
        """One optimizer step on this DP rank's chunk; ``meta_info["metrics"]`` holds the metrics."""
        batch, _ = self._planned_chunk(data)
        metrics = self.actor.update_actor(batch)
        return DataProto(batch=None, meta_info={"metrics": _plain_metrics(metrics)})

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name=ACTOR_MESH))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` (B, L) token-aligned, plus ``entropys`` when meta ``calculate_entropy``."""
        with_entropy = bool(data.meta_info.get("calculate_entropy", False))
        batch, order = self._planned_chunk(data)
        out = self.actor.compute_log_prob(batch, with_entropy=with_entropy)
        restore = np.argsort(order, kind="stable")
        tensors = {OLD_LOG_PROBS_KEY: out.tensors[LOG_PROBS_KEY][torch.as_tensor(restore)]}
        if with_entropy:
            tensors[VERL_ENTROPY_KEY] = out.tensors[ENTROPY_KEY][torch.as_tensor(restore)]
        return batch_to_dataproto(Batch.from_dict(tensors=tensors))

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        """Sharded checkpoint under ``local_path`` (collective over all ranks)."""
        if hdfs_path is not None:
            raise VerlWorkerConfigError(f"hdfs_path={hdfs_path!r} is not supported; copy local_path yourself")
        if max_ckpt_to_keep is not None:
            logger.warning("VerlActorWorker ignores max_ckpt_to_keep; prune old checkpoints outside")
        os.makedirs(local_path, exist_ok=True)
        unseal(local_path)  # a save stopped half-way never looks complete
        self.actor.save_checkpoint(local_path, step=int(global_step), extra={"global_step": int(global_step)})
        seal(local_path, step=int(global_step), group=self.actor.layout.world_group)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        """Restore ``save_checkpoint(local_path)``; returns the saved extra dict."""
        if hdfs_path is not None:
            raise VerlWorkerConfigError(f"hdfs_path={hdfs_path!r} is not supported; load from a local path")
        # the completeness record and checksums first
        verify_sealed(local_path, group=self.actor.layout.world_group)
        extra = self.actor.load_checkpoint(local_path)
        if del_local_after_load:
            dist.barrier()  # every rank has finished reading before rank 0 deletes
            if self.rank == 0:
                shutil.rmtree(local_path, ignore_errors=True)
        return extra


def _plain_metrics(metrics: dict) -> dict:
    """Metrics as Python scalars/lists so they pickle cheaply and concat across ranks."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else value.tolist()
        out[key] = value
    return out
