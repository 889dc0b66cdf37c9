"""The worker groups as the driver sees them: ``ActorGroup``, ``ActorRolloutGroup`` and ``CriticGroup``,
on the ``EngineGroup`` base that declares the methods every engine worker has.

Each declares its worker class's ``@register``'ed methods with ``@group_method`` (typed, checked
signatures; the docstring names the worker method run on every rank). ``group_class_for(worker_cls)``
picks the group class for a worker class.

Mesh-dispatched calls take one ``Batch`` per DP rank and return SP rank 0's outputs of each DP
group, in DP order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_balance.protocol import Batch
from verl_balance.single_controller.worker_group import RayWorkerGroup, group_method
from verl_balance.workers.actor import ActorWorker
from verl_balance.workers.actor_rollout import ActorRolloutWorker
from verl_balance.workers.critic import CriticWorker

if TYPE_CHECKING:
    from verl_balance.rollout import RolloutOutput

__all__ = ["ActorGroup", "ActorRolloutGroup", "CriticGroup", "EngineGroup", "group_class_for"]


class EngineGroup(RayWorkerGroup):
    """The methods every engine worker registers (``ActorWorker``'s; a ``CriticGroup`` call runs
    ``CriticWorker``'s)."""

    @group_method
    def init_model(self) -> list[dict]:
        """``ActorWorker.init_model`` on every rank: process group, mesh and sharded engine."""
        ...

    @group_method
    def eval_loss(self, chunks: list[Batch]) -> list[dict]:
        """``ActorWorker.eval_loss``: the training objective without backward; per-DP-rank metrics."""
        ...

    @group_method
    def describe(self) -> list[dict]:
        """``ActorWorker.describe`` on every rank: layout, model dims and engine settings."""
        ...

    @group_method
    def save_checkpoint(self, path: str, step: int, extra: dict | None = None) -> list[None]:
        """``ActorWorker.save_checkpoint`` on every rank (collective): sharded engine state."""
        ...

    @group_method
    def load_checkpoint(self, path: str) -> list[dict]:
        """``ActorWorker.load_checkpoint`` on every rank: restores it; each rank's saved ``extra``."""
        ...

    @group_method
    def hash_checkpoint_files(self, path: str, sizes: dict[str, int]) -> list[dict[str, dict]]:
        """``ActorWorker.hash_checkpoint_files`` on every rank; the union of the dicts covers every file."""
        ...


class ActorGroup(EngineGroup):
    """Driver-side worker group of ``workers.actor.ActorWorker`` ranks."""

    @group_method
    def update_actor(self, chunks: list[Batch]) -> list[dict]:
        """``ActorWorker.update_actor``: one optimizer step on the global mini-batch; per-DP-rank metrics."""
        ...

    @group_method
    def compute_log_prob(
        self, chunks: list[Batch], with_entropy: bool = False, with_sum_pi_squared: bool = False
    ) -> Batch:
        """``ActorWorker.compute_log_prob``: per-token ``log_probs`` (and extras) in DP order."""
        ...

    @group_method
    def set_loss_mode(self, loss_mode) -> None:
        """``ActorWorker.set_loss_mode``: the next updates' ``policy_loss.loss_mode`` on every rank."""
        ...


class ActorRolloutGroup(ActorGroup):
    """Driver-side worker group of ``workers.actor_rollout.ActorRolloutWorker`` ranks."""

    @group_method
    def generate_sequences(self, chunks: list[Batch], sampling: dict, seed: int) -> list[RolloutOutput | None]:
        """``ActorRolloutWorker.generate_sequences``: one prompt chunk per worker; outputs in worker-rank order."""
        ...

    @group_method
    def compute_ref_log_prob(self, chunks: list[Batch]) -> Batch:
        """``ActorRolloutWorker.compute_ref_log_prob``: per-token ``ref_log_prob``, in DP order."""
        ...

    @group_method
    def load_model_weights(self, path: str) -> list[None]:
        """``ActorRolloutWorker.load_model_weights`` on every rank: weights of a checkpoint only."""
        ...

    @group_method
    def sync_reference_policy(self) -> list[None]:
        """``ActorRolloutWorker.sync_reference_policy`` on every rank: reference := actor weights."""
        ...


class CriticGroup(EngineGroup):
    """Driver-side worker group of ``workers.critic.CriticWorker`` ranks (the value model)."""

    @group_method
    def compute_values(self, chunks: list[Batch]) -> Batch:
        """``CriticWorker.compute_values``: per-token ``values`` of every row, in DP order."""
        ...

    @group_method
    def load_backbone_weights(self, path: str) -> list[bool]:
        """``CriticWorker.load_backbone_weights`` on every rank; per rank, whether the head was loaded."""
        ...

    @group_method
    def update_critic(self, chunks: list[Batch]) -> list[dict]:
        """``CriticWorker.update_critic``: one optimizer step of the clipped value loss; per-DP-rank metrics."""
        ...


def group_class_for(worker_cls: type) -> type[RayWorkerGroup]:
    """The group class that declares ``worker_cls``'s methods (a plain ``RayWorkerGroup`` for others)."""
    if issubclass(worker_cls, CriticWorker):
        return CriticGroup
    if issubclass(worker_cls, ActorRolloutWorker):
        return ActorRolloutGroup
    if issubclass(worker_cls, ActorWorker):
        return ActorGroup
    return RayWorkerGroup
