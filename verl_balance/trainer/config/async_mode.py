"""verl's ``trainer.v1`` keys (the trainer mode and the off-policy sampler) and their checks.

``trainer.v1.trainer_mode``: ``sync`` (default, ``GRPOTrainer``); ``separate_async``
(``AsyncGRPOTrainer`` with its own rollout pool of ``rollout.nnodes x n_gpus_per_node`` workers,
generating batch k+1 while the actor trains on batch k); ``colocate_async`` (generating on the actor
workers' rollout, ``colocate_async.num_warmup_batches`` ahead).

``separate_async`` needs ``data.train_batch_size = parameter_sync_step x ppo_mini_batch_size``
(verl's rule); unset values are derived and named in a start-up line.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from verl_balance.engine.config import APPLY_ON_RESUME
from verl_balance.trainer.config.checks import ConfigError, check_choice, check_positive

TRAINER_MODES = ("sync", "colocate_async", "separate_async")
OFF_POLICY_STRATEGIES = ("drop", "wait")
MODE_KEY = "trainer.v1.trainer_mode"
DEFAULT_ROLLOUT_NNODES = 1
"""separate_async's rollout pool nodes when actor_rollout_ref.rollout.nnodes is 0 (verl's default)."""

logger = logging.getLogger(__name__)


@dataclass
class ColocateAsyncSection:
    """verl's ``trainer.v1.colocate_async``."""

    num_warmup_batches: int = 1
    """Batches generated ahead of training (1 = one-step off-policy)."""

    def __post_init__(self) -> None:
        check_positive("num_warmup_batches", self.num_warmup_batches)


@dataclass
class SeparateAsyncSection:
    """verl's ``trainer.v1.separate_async``."""

    num_warmup_batches: int = 1
    """Batches in flight ahead of training: batch k uses the weights of step max(k - num_warmup_batches, 0)."""
    parameter_sync_step: Optional[int] = None
    """Optimizer steps between two weight syncs actor -> rollout; data.train_batch_size must equal
    parameter_sync_step x actor.ppo_mini_batch_size. null = that quotient."""

    def __post_init__(self) -> None:
        check_positive("num_warmup_batches", self.num_warmup_batches)
        if self.parameter_sync_step is not None:
            check_positive("parameter_sync_step", self.parameter_sync_step)


@dataclass
class SamplerSection:
    """verl's ``trainer.v1.sampler``: how stale a sample may be when it is trained on."""

    max_off_policy_threshold: int = 8
    """Most policy versions between the weights that generated a sample and the weights it trains."""
    max_off_policy_strategy: str = "drop"
    """drop: groups older than the threshold are not trained on; wait: generation waits so none gets older."""

    def __post_init__(self) -> None:
        check_positive("max_off_policy_threshold", self.max_off_policy_threshold)
        check_choice("max_off_policy_strategy", self.max_off_policy_strategy, OFF_POLICY_STRATEGIES)


@dataclass
class V1Section:
    """verl's ``trainer.v1``: the trainer mode and its settings."""

    trainer_mode: str = field(default="sync", metadata=APPLY_ON_RESUME)
    """sync | colocate_async | separate_async (see trainer/config/async_mode.py)."""
    colocate_async: ColocateAsyncSection = field(default_factory=ColocateAsyncSection)
    """The colocated asynchronous mode's settings."""
    separate_async: SeparateAsyncSection = field(default_factory=SeparateAsyncSection)
    """The separate-rollout-pool mode's settings."""
    sampler: SamplerSection = field(default_factory=SamplerSection)
    """Bounded staleness of the asynchronous modes."""

    def __post_init__(self) -> None:
        check_choice("trainer_mode", self.trainer_mode, TRAINER_MODES)

    @property
    def lookahead(self) -> int:
        """Batches generated ahead: ``num_warmup_batches``, capped at ``max_off_policy_threshold`` under ``wait``."""
        mode = self.colocate_async if self.trainer_mode == "colocate_async" else self.separate_async
        ahead = mode.num_warmup_batches
        if self.sampler.max_off_policy_strategy == "wait":
            ahead = min(ahead, self.sampler.max_off_policy_threshold)
        return ahead


def check_async(config) -> None:
    """Cross-section checks of ``trainer.v1`` on a validated ``GRPOConfig`` (ConfigError naming the keys)."""
    v1 = config.trainer.v1
    mode = v1.trainer_mode
    if mode == "sync":
        return
    section = v1.colocate_async if mode == "colocate_async" else v1.separate_async
    if mode == "separate_async":
        _default_rollout_pool(config)
        _check_rollout_pool(config.actor_rollout_ref.rollout)
        if v1.separate_async.parameter_sync_step is None:
            _derive_sync_step(config)
        _check_sync_step(config, v1.separate_async.parameter_sync_step)
    _check_staleness(v1.sampler, section.num_warmup_batches, key=f"trainer.v1.{mode}.num_warmup_batches")
    _check_async_algorithm(config, mode)


def _default_rollout_pool(config) -> None:
    """rollout.nnodes 0 (verl's default: no pool) -> DEFAULT_ROLLOUT_NNODES, named once."""
    rollout = config.actor_rollout_ref.rollout
    if rollout.nnodes == 0:
        rollout.nnodes = DEFAULT_ROLLOUT_NNODES
        logger.info(
            "%s=separate_async: actor_rollout_ref.rollout.nnodes not set, using %d node x n_gpus_per_node=%d "
            "rollout workers (set actor_rollout_ref.rollout.nnodes / n_gpus_per_node to size the pool)",
            MODE_KEY,
            rollout.nnodes,
            rollout.n_gpus_per_node,
        )


def _derive_sync_step(config) -> None:
    """parameter_sync_step unset -> data.train_batch_size / actor.ppo_mini_batch_size, named once."""
    actor, batch = config.actor_rollout_ref.actor, config.data.train_batch_size
    section = config.trainer.v1.separate_async
    section.parameter_sync_step = max(batch // actor.ppo_mini_batch_size, 1)
    logger.info(
        "%s=separate_async: trainer.v1.separate_async.parameter_sync_step not set, using %d = data.train_batch_size"
        " %d / actor_rollout_ref.actor.ppo_mini_batch_size %d (the rollout gets new weights once per step)",
        MODE_KEY,
        section.parameter_sync_step,
        batch,
        actor.ppo_mini_batch_size,
    )


def _check_rollout_pool(rollout) -> None:
    if rollout.nnodes < 1 or rollout.rollout_workers < 1:
        raise ConfigError(
            f"{MODE_KEY}='separate_async' needs its own rollout workers: actor_rollout_ref.rollout.nnodes="
            f"{rollout.nnodes} x n_gpus_per_node={rollout.n_gpus_per_node}; set both >= 1 (verl's keys)"
        )


def _check_sync_step(config, sync_step: int) -> None:
    actor, batch = config.actor_rollout_ref.actor, config.data.train_batch_size
    if sync_step * actor.ppo_mini_batch_size != batch:
        raise ConfigError(
            f"trainer.v1.separate_async.parameter_sync_step={sync_step} x actor_rollout_ref.actor."
            f"ppo_mini_batch_size={actor.ppo_mini_batch_size} must equal data.train_batch_size={batch} (verl's "
            f"rule: the rollout gets new weights once per step); set parameter_sync_step="
            f"{batch // actor.ppo_mini_batch_size}"
        )


def _check_staleness(sampler: SamplerSection, warmup: int, *, key: str) -> None:
    if sampler.max_off_policy_strategy == "drop" and warmup > sampler.max_off_policy_threshold:
        raise ConfigError(
            f"{key}={warmup} generates batches that many versions ahead, more than "
            f"trainer.v1.sampler.max_off_policy_threshold={sampler.max_off_policy_threshold}: with "
            "max_off_policy_strategy=drop every batch after the first would be dropped; lower num_warmup_batches, "
            "raise the threshold, or use max_off_policy_strategy=wait"
        )


def _check_async_algorithm(config, mode: str) -> None:
    if config.algorithm.adv_estimator == "remax":
        raise ConfigError(
            f"{MODE_KEY}={mode!r} with algorithm.adv_estimator=remax is not supported yet (its greedy baseline "
            "rollout would run with other weights than the batch's); use trainer.v1.trainer_mode=sync or another "
            "estimator"
        )
    if config.use_critic:
        raise ConfigError(
            f"{MODE_KEY}={mode!r} with algorithm.adv_estimator=gae is not supported yet (the critic's values would "
            "be stale too); use a critic-free estimator such as grpo, or trainer.v1.trainer_mode=sync"
        )


__all__ = [
    "MODE_KEY",
    "OFF_POLICY_STRATEGIES",
    "TRAINER_MODES",
    "SamplerSection",
    "SeparateAsyncSection",
    "V1Section",
    "check_async",
]
