"""The worker groups as the driver sees them: typed ``Protocol``s of the ``@register``'ed methods.

A ``RayWorkerGroup`` built on ``ActorWorker`` (or ``ActorRolloutWorker``) gets one driver-side
method per registered worker method, which dispatches, runs on every rank and collects. These
Protocols give those methods their driver-side signatures; each docstring names the worker method
that runs on every rank (``ActorWorker.update_actor`` ...), which is where the work is done.

Mesh-dispatched calls take one ``Batch`` per DP rank (``trainer.plan_dispatch.split_by_plan``)
and return the outputs of SP rank 0 of each DP group, in DP order: a list of dicts, or one
``Batch`` concatenated in DP order (``merge_by_plan`` restores the input row order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from verl_balance.protocol import Batch

if TYPE_CHECKING:
    from verl_balance.rollout import RolloutOutput

__all__ = ["ActorGroup", "ActorRolloutGroup"]


@runtime_checkable
class ActorGroup(Protocol):
    """Driver-side view of a worker group of ``workers.actor.ActorWorker`` ranks."""

    resource_pool: Any
    """The placement of the workers (``single_controller.RayResourcePool``)."""

    def init_model(self) -> list[dict]:
        """``ActorWorker.init_model`` on every rank: process group, mesh and sharded engine."""
        ...

    def update_actor(self, chunks: list[Batch]) -> list[dict]:
        """``ActorWorker.update_actor``: one optimizer step on the global mini-batch; per-DP-rank
        metrics (loss and grad norm are already global, timings are the rank's own)."""
        ...

    def eval_loss(self, chunks: list[Batch]) -> list[dict]:
        """``ActorWorker.eval_loss``: the training objective without backward; per-DP-rank metrics."""
        ...

    def compute_log_prob(self, chunks: list[Batch], with_entropy: bool = False) -> Batch:
        """``ActorWorker.compute_log_prob``: per-token ``log_probs`` (and ``entropy``) of every row,
        concatenated in DP order."""
        ...

    def describe(self) -> list[dict]:
        """``ActorWorker.describe`` on every rank: layout, model dims and engine settings."""
        ...

    def save_checkpoint(self, path: str, step: int, extra: dict | None = None) -> list[None]:
        """``ActorWorker.save_checkpoint`` on every rank (collective): sharded engine state."""
        ...

    def load_checkpoint(self, path: str) -> list[dict]:
        """``ActorWorker.load_checkpoint`` on every rank: restores it; each rank's saved ``extra``."""
        ...

    def hash_checkpoint_files(self, path: str, sizes: dict[str, int]) -> list[dict[str, dict]]:
        """``ActorWorker.hash_checkpoint_files`` on every rank: each hashes its share of the files
        ``sizes`` names under ``path``; the union of the returned dicts covers every file."""
        ...

    def shutdown(self) -> None:
        """Stop the worker processes (``RayWorkerGroup.shutdown``)."""
        ...


@runtime_checkable
class ActorRolloutGroup(ActorGroup, Protocol):
    """Driver-side view of a worker group of ``workers.actor_rollout.ActorRolloutWorker`` ranks."""

    def generate_sequences(self, chunks: list[Batch], sampling: dict, seed: int) -> list[RolloutOutput | None]:
        """``ActorRolloutWorker.generate_sequences``: one prompt chunk per worker (rollout mesh);
        each worker's RolloutOutput (None for an empty chunk), in worker-rank order."""
        ...

    def compute_ref_log_prob(self, chunks: list[Batch]) -> Batch:
        """``ActorRolloutWorker.compute_ref_log_prob``: per-token ``ref_log_prob`` under the frozen
        reference policy, concatenated in DP order."""
        ...

    def load_model_weights(self, path: str) -> list[None]:
        """``ActorRolloutWorker.load_model_weights`` on every rank: weights of a checkpoint only."""
        ...

    def sync_reference_policy(self) -> list[None]:
        """``ActorRolloutWorker.sync_reference_policy`` on every rank: reference := actor weights."""
        ...
