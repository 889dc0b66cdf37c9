"""Weight sync from the actor group to a separate rollout group, in buckets of whole tensors.

The actor's parameters are FSDP shards (DTensors). A sync walks them in ``state_dict`` order in
buckets of at most ``bucket_bytes`` (a tensor larger than that is a bucket of its own): for each
bucket every actor rank joins the all-gather of each tensor (``DTensor.full_tensor``, a collective
over the mesh), and only global rank 0 returns the unsharded tensors, on the CPU; the driver hands
them on to every rollout worker. At no time does any process hold more than one bucket of
unsharded tensors beyond its own state: never a full model gathered on one rank.

The tensors are exactly those of ``TrainEngine.full_state_dict`` (same names, dtype and values),
so a rollout worker fed every bucket holds what the colocated rollout would have read.

With LoRA the rollout worker holds the frozen base and the adapters and merges them itself
(``workers/rollout_worker.py``): the first sync to a (new) rollout group sends every tensor, the
later ones only the adapters (``weight_buckets(adapters_only=True)``).

Invariants: every actor rank computes the same bucket plan (from the global shapes and dtypes of
its state dict, in its order) and joins every ``export_weight_bucket`` call with the same names,
so the collectives line up.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from verl_balance.engine.lora import is_lora_name, lora_scaling
from verl_balance.single_controller import Dispatch, register
from verl_balance.workers.actor_rollout import ActorRolloutWorker
from verl_balance.workers.buckets import DEFAULT_BUCKET_BYTES, plan_buckets, tensor_bytes


class AsyncActorRolloutWorker(ActorRolloutWorker):
    """``ActorRolloutWorker`` plus the actor side of the weight sync to a separate rollout group."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weight_buckets(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, adapters_only: bool = False) -> dict:
        """This rank's plan: {"buckets": [[name, ...], ...], "bytes": total unsharded bytes,
        "lora_scaling": peft's factor on B @ A, None without LoRA}; ``adapters_only`` (a LoRA
        actor) plans the adapter tensors only."""
        lora = getattr(self.engine.model, "lora_config", None)
        assert lora is not None or not adapters_only, "adapters_only needs a LoRA actor"
        sizes = [
            (name, tensor_bytes(value))
            for name, value in self.engine.model.state_dict().items()
            if not adapters_only or is_lora_name(name)
        ]
        return {
            "buckets": plan_buckets(sizes, bucket_bytes=bucket_bytes),
            "bytes": sum(b for _, b in sizes),
            "lora_scaling": None if lora is None else lora_scaling(lora),
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_weight_bucket(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """The unsharded tensors ``names`` on CPU from global rank 0 (None on the others).
        Collective: every rank must join with the same names."""
        state = self.engine.model.state_dict()
        out = {}
        for name in names:
            value = state[name]
            full = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
            if self.rank == 0:
                out[name] = full.cpu().clone()
        return out if self.rank == 0 else None


__all__ = ["AsyncActorRolloutWorker", "DEFAULT_BUCKET_BYTES", "plan_buckets", "tensor_bytes"]
