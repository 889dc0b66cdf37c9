"""The worker groups as the driver sees them: ``ActorGroup``, ``ActorRolloutGroup`` and ``CriticGroup``,
on the ``EngineGroup`` base that declares the methods every engine worker has.

Each is a ``RayWorkerGroup`` that declares the ``@register``'ed methods of its worker class with
``@group_method``: the declaration gives the driver-side signature (checked on every call) and a
docstring naming the worker method that runs on every rank (``ActorWorker.update_actor`` ...),
which is where the work is done; the call dispatches, runs on every rank and collects, and
``.submit(...)`` starts it without waiting. "Go to definition" on ``self.actor.update_actor``
lands here. ``group_class_for(worker_cls)`` picks the group class for a worker class; a worker
subclass's extra registered methods are still bound by name (``RayWorkerGroup``).

Mesh-dispatched calls take one ``Batch`` per DP rank (``trainer.plan_dispatch.split_by_plan``)
and return the outputs of SP rank 0 of each DP group, in DP order: a list of dicts, or one
``Batch`` concatenated in DP order (``merge_by_plan`` restores the input row order).
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
    """The methods every engine worker registers (``ActorWorker``'s, which ``CriticWorker`` inherits
    or overrides): set-up, evaluation, description and checkpoints. ``ActorGroup`` and
    ``CriticGroup`` add their own; a docstring names ``ActorWorker``'s method, and a ``CriticGroup``
    call runs ``CriticWorker``'s."""

    @group_method
    def init_model(self) -> list[dict]:
        """``ActorWorker.init_model`` (``CriticWorker.init_model``) on every rank: process group,
        mesh and sharded engine (the language model's, or the value model's)."""
        ...

    @group_method
    def eval_loss(self, chunks: list[Batch]) -> list[dict]:
        """``ActorWorker.eval_loss``: the training objective without backward (a critic's: the value
        loss); per-DP-rank metrics."""
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
        """``ActorWorker.hash_checkpoint_files`` on every rank: each hashes its share of the files
        ``sizes`` names under ``path``; the union of the returned dicts covers every file."""
        ...


class ActorGroup(EngineGroup):
    """Driver-side worker group of ``workers.actor.ActorWorker`` ranks."""

    @group_method
    def update_actor(self, chunks: list[Batch]) -> list[dict]:
        """``ActorWorker.update_actor``: one optimizer step on the global mini-batch; per-DP-rank
        metrics (loss and grad norm are already global, timings are the rank's own)."""
        ...

    @group_method
    def compute_log_prob(
        self, chunks: list[Batch], with_entropy: bool = False, with_sum_pi_squared: bool = False
    ) -> Batch:
        """``ActorWorker.compute_log_prob``: per-token ``log_probs`` (and ``entropy``, ``sum_pi_squared``)
        of every row, concatenated in DP order."""
        ...

    @group_method
    def set_loss_mode(self, loss_mode) -> None:
        """``ActorWorker.set_loss_mode``: the next updates' ``policy_loss.loss_mode`` on every rank."""
        ...


class ActorRolloutGroup(ActorGroup):
    """Driver-side worker group of ``workers.actor_rollout.ActorRolloutWorker`` ranks."""

    @group_method
    def generate_sequences(self, chunks: list[Batch], sampling: dict, seed: int) -> list[RolloutOutput | None]:
        """``ActorRolloutWorker.generate_sequences``: one prompt chunk per worker (rollout mesh);
        each worker's RolloutOutput (None for an empty chunk), in worker-rank order."""
        ...

    @group_method
    def compute_ref_log_prob(self, chunks: list[Batch]) -> Batch:
        """``ActorRolloutWorker.compute_ref_log_prob``: per-token ``ref_log_prob`` under the frozen
        reference policy, concatenated in DP order."""
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
        """``CriticWorker.compute_values``: per-token ``values`` of every row (aligned like
        ``compute_log_prob``'s log_probs), concatenated in DP order."""
        ...

    @group_method
    def load_backbone_weights(self, path: str) -> list[bool]:
        """``CriticWorker.load_backbone_weights`` on every rank: the decoder of an engine checkpoint
        (and its value head when it has one); per rank, whether the head was loaded."""
        ...

    @group_method
    def update_critic(self, chunks: list[Batch]) -> list[dict]:
        """``CriticWorker.update_critic``: one optimizer step of the clipped value loss on the global
        mini-batch; per-DP-rank metrics (vf_loss, vf_clipfrac, vpred_mean, grad_norm are global)."""
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
