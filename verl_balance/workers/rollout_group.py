"""``RolloutGroup``: the driver's view of a separate rollout worker group (``workers/rollout_worker.py``)."""

from __future__ import annotations

import torch

from verl_balance.protocol import Batch
from verl_balance.single_controller.worker_group import RayWorkerGroup, group_method


class RolloutGroup(RayWorkerGroup):
    """Driver-side worker group of ``workers.rollout_worker.RolloutWorker`` ranks."""

    @group_method
    def init_model(self) -> list[dict]:
        """``RolloutWorker.init_model`` on every rank: the rollout engine, no weights yet."""
        ...

    @group_method
    def receive_weights(self, bucket: dict[str, torch.Tensor], version: int, last: bool) -> list[None]:
        """``RolloutWorker.receive_weights`` on every rank: one bucket of the actor's unsharded tensors."""
        ...

    @group_method
    def weights_checksum(self) -> list[dict]:
        """``RolloutWorker.weights_checksum`` on every rank: version and float64 sums of the weights it
        generates with."""
        ...

    @group_method
    def generate_sequences(self, chunks: list[Batch], sampling: dict, seed: int) -> list[dict]:
        """``RolloutWorker.generate_sequences``: one prompt chunk per worker; per worker
        {"output", "version", "busy_s"} in worker-rank order."""
        ...


__all__ = ["RolloutGroup"]
