"""The critic's part of a GRPO/PPO step, one object for the run: ``CriticRole`` (a value model,
``algorithm.adv_estimator=gae``) or ``NoCritic``, whose every method is the step without a critic.

Order within a step: ``submit_values``, ``attach_returns``, ``train`` (before the actor's update).
The critic's shards are saved under ``critic/`` in every ``global_step_N``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from verl_balance.batch_keys import CRITIC_UPDATE_KEYS, LOG_PROB_INPUT_KEYS, LOSS_MASK_KEY, RETURNS_KEY, VALUES_KEY
from verl_balance.protocol import Batch
from verl_balance.trainer import checkpoint, cluster
from verl_balance.trainer.grpo.rollout_batch import mini_batch_rows
from verl_balance.trainer.grpo.step_metrics import mean_metrics, timed
from verl_balance.trainer.metrics import reduce_rank_metrics
from verl_balance.trainer.plan_dispatch import split_by_plan
from verl_balance.workers.group import ActorRolloutGroup, CriticGroup

logger = logging.getLogger(__name__)
CRITIC_CHECKPOINT_DIR = "critic"
"""The critic's shards inside a ``global_step_N`` checkpoint (the actor's are at its root)."""


def value_metrics(batch: Batch) -> dict:
    """verl's critic data metrics: mean values and returns, and the explained variance (unbiased variances)."""
    mask = batch[LOSS_MASK_KEY].bool()
    values, returns = batch[VALUES_KEY][mask].double(), batch[RETURNS_KEY][mask].double()
    if values.numel() < 2:
        return {}
    return {
        "critic/values/mean": float(values.mean()),
        "critic/returns/mean": float(returns.mean()),
        "critic/vf_explained_var": float(1.0 - (returns - values).var() / (returns.var() + 1e-5)),
    }


class ActorCriticCheckpoint:
    """What ``trainer.checkpoint`` saves with a critic: the actor's shards at the root, the critic's under
    ``critic/``; one manifest covers both."""

    def __init__(self, actor: ActorRolloutGroup, critic: CriticGroup) -> None:
        self.actor, self.critic = actor, critic

    def save_checkpoint(self, path: str, step: int, extra: dict | None = None) -> None:
        self.actor.save_checkpoint(path, step, extra)
        self.critic.save_checkpoint(os.path.join(path, CRITIC_CHECKPOINT_DIR), step)

    def load_checkpoint(self, path: str) -> None:
        critic_path = os.path.join(path, CRITIC_CHECKPOINT_DIR)
        if not os.path.isdir(critic_path):
            raise checkpoint.CheckpointError(
                f"checkpoint {path!r} has no {CRITIC_CHECKPOINT_DIR}/ directory: it was written without a critic "
                "(algorithm.adv_estimator other than gae); start a PPO run from its weights with "
                "actor_rollout_ref.model.warm_start_path instead"
            )
        self.actor.load_checkpoint(path)
        self.critic.load_checkpoint(critic_path)

    def hash_checkpoint_files(self, path: str, sizes: dict[str, int]) -> list[dict[str, dict]]:
        return self.actor.hash_checkpoint_files(path, sizes)


class NoCritic:
    """A step without a critic (every estimator but gae): no values, no returns, nothing to train."""

    algorithm = "GRPO"

    def checkpoint_group(self, actor: ActorRolloutGroup) -> ActorRolloutGroup:
        return actor

    def release(self) -> None:
        pass

    def restart(self) -> None:
        pass

    def warm_start(self, path: str) -> None:
        pass

    def submit_values(self, batch: Batch, *, pending: dict, metrics: dict) -> None:
        pass

    def attach_returns(self, batch: Batch, returns: torch.Tensor | None) -> None:
        pass

    def train(self, batch: Batch, *, metrics: dict, phase: Callable[[str], None]) -> None:
        pass


NO_CRITIC = NoCritic()


class CriticRole:
    """The critic's worker group (the actor's world size and Ulysses degree) and the step's critic work;
    ``start()`` builds a group, ``plan(...)`` is the trainer's DP plan."""

    algorithm = "PPO"

    def __init__(self, *, config, start: Callable[[], CriticGroup], plan: Callable[..., object]) -> None:
        self.config, self._start, self._plan = config, start, plan
        self.group = start()

    def checkpoint_group(self, actor: ActorRolloutGroup) -> ActorCriticCheckpoint:
        return ActorCriticCheckpoint(actor, self.group)

    def release(self) -> None:
        cluster.release_group(self.group)

    def restart(self) -> None:
        """Replace a broken critic group by a fresh one (it resumes from the actor's checkpoint)."""
        cluster.release_group(self.group, broken="the old critic group")
        self.group = self._start()

    def warm_start(self, path: str) -> None:
        """A critic without its own model starts from the actor's warm-start decoder (LoRA: the shared base)."""
        from verl_balance.engine.lora import read_base_fingerprint

        if self.config.model.path is not None:
            return
        if read_base_fingerprint(path) is not None:
            logger.info("critic warm start: %s holds LoRA adapters only; the critic keeps the base weights", path)
            return
        head = self.group.load_backbone_weights(path)[0]
        logger.info("critic warm start: decoder%s of %s", " and value head" if head else "", path)

    def submit_values(self, batch: Batch, *, pending: dict, metrics: dict) -> None:
        """Start the values pass on the critic's own plan without waiting: ``pending[values] = (plan, GroupFuture)``."""
        c = self.config
        with timed(metrics, VALUES_KEY):
            plan = self._plan(
                batch,
                micro_batch_size=c.ppo_micro_batch_size_per_gpu,
                token_cap=c.ppo_max_token_len_per_gpu if c.use_dynamic_bsz else None,
            )
            inputs = batch.select(batch_keys=LOG_PROB_INPUT_KEYS, non_tensor_batch_keys=[])
            pending[VALUES_KEY] = plan, self.group.compute_values.submit(split_by_plan(inputs, plan))

    def attach_returns(self, batch: Batch, returns: torch.Tensor | None) -> None:
        """GAE's ``returns``, the value loss's targets."""
        if returns is not None:
            batch[RETURNS_KEY] = returns

    def train(self, batch: Batch, *, metrics: dict, phase: Callable[[str], None]) -> None:
        """verl's critic data metrics, then critic.ppo_epochs x mini-batches value-loss steps, into ``metrics``."""
        metrics.update(value_metrics(batch))
        phase("critic update")
        with timed(metrics, "update_critic"):
            metrics.update(self._value_updates(batch))

    def _value_updates(self, batch: Batch) -> dict:
        """The mean of the critic's global metrics over its optimizer steps."""
        c = self.config
        cap = c.ppo_max_token_len_per_gpu if c.use_dynamic_bsz else None
        records = []
        for _ in range(c.ppo_epochs):
            for rows in mini_batch_rows(batch, size=c.ppo_mini_batch_size):
                mini = batch.index_select(rows)
                plan = self._plan(mini, micro_batch_size=c.ppo_micro_batch_size_per_gpu, token_cap=cap)
                inputs = mini.select(batch_keys=CRITIC_UPDATE_KEYS, non_tensor_batch_keys=[])
                per_rank = self.group.update_critic(split_by_plan(inputs, plan))
                reduced = reduce_rank_metrics(per_rank, prefix="critic/")
                records.append({k: v for k, v in reduced.items() if k.startswith("critic/")})
        out = mean_metrics(records)
        out["critic/num_optimizer_steps"] = float(len(records))
        return out


__all__ = ["CRITIC_CHECKPOINT_DIR", "NO_CRITIC", "ActorCriticCheckpoint", "CriticRole", "NoCritic", "value_metrics"]
