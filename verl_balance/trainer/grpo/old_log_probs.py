"""Where a GRPO step's PPO old log-probs come from: decided once per step, before its passes, and
passed to the passes and the update as an argument."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OldLogProbs:
    """A step's old-log-prob decision. ``from_update`` implies no ``recompute`` (the on-policy forward's
    own, ratio exactly 1); with neither, they are the rollout's recorded log-probs."""

    recompute: bool
    """The actor's old-log-prob pass runs on the batch before the advantages (``train/old_log_prob_pass``)."""
    from_update: bool
    """The update takes ``log_prob.detach()`` of its own forward as the old log-probs."""

    def __post_init__(self) -> None:
        assert not (self.recompute and self.from_update), self

    @classmethod
    def sync(cls, config) -> OldLogProbs:
        """The sync trainer's: from the update when allowed, the rollout's with bypass_mode, else the pass."""
        from_update = config.old_log_prob_from_update
        bypass = config.algorithm.rollout_correction.bypass_mode
        return cls(recompute=not from_update and not bypass, from_update=from_update)

    @classmethod
    def off_policy(cls, config) -> OldLogProbs:
        """The async trainer's: the pass only with ``recompute_old_log_prob=always`` and without bypass_mode."""
        recompute = config.actor_rollout_ref.actor.recompute_old_log_prob == "always"
        return cls(recompute=recompute and not config.algorithm.rollout_correction.bypass_mode, from_update=False)


__all__ = ["OldLogProbs"]
