"""verl's RL-algorithm keys of the GRPO recipe: ``algorithm.*`` and ``actor_rollout_ref.actor.policy_loss.*``.

Names, defaults and meanings are verl 0.9.1's (``trainer/config/*.yaml``, ``trainer/ppo/core_algos.py``),
so a verl launch script's algorithm overrides carry over. ``grpo_config`` nests ``AlgorithmSection``
as ``algorithm`` and ``ActorAlgorithmKeys`` into ``actor_rollout_ref.actor``.

Invariants:
- ``algorithm.adv_estimator`` is any name of ``algorithms.ADV_ESTIMATOR_REGISTRY`` that this trainer can
  feed (``SUPPLIED_INPUTS``); an estimator needing an input the trainer does not derive fails at
  start-up naming the key and the missing input (never a silent fallback).
- ``actor_rollout_ref.actor.policy_loss.loss_mode`` is any name of ``algorithms.LOSS_MODE_REGISTRY``
  whose reductions the engine supplies (``ENGINE_LOSS_MODES``); the others fail naming the key.
- Keys of features main_grpo does not run yet (KL in the reward, dynamic sampling, overlong shaping,
  rollout correction) are accepted at verl's defaults and refused, naming the key, when changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

from verl_balance.algorithms import ADV_ESTIMATOR_REGISTRY, LOSS_MODE_REGISTRY, AdvantageParams, LossModeConfig
from verl_balance.algorithms.estimators import required_inputs
from verl_balance.algorithms.loss_modes import SEQ_MEAN_TOKEN_MEAN, LossModeKeys
from verl_balance.algorithms.rollout_correction import RolloutCorrectionConfig
from verl_balance.batch_keys import INDEX_KEY, OLD_LOG_PROBS_KEY, VALUES_KEY
from verl_balance.trainer.config_checks import ConfigError, check_choice

SUPPLIED_INPUTS = (INDEX_KEY, VALUES_KEY, "reward_baselines", "reward_components")
"""``AdvantageInputs`` fields the GRPO trainer supplies: the prompt uid of each row, the critic's values
(gae), the greedy baseline rollout's reward (remax) and the reward function's extra fields (gdpo)."""
UNSUPPLIED_REASONS = {
    "sum_pi_squared": (
        "the per-token sum over the vocabulary of pi^2 (verl's actor.calculate_sum_pi_squared), which the "
        "chunked output head does not compute yet"
    ),
    OLD_LOG_PROBS_KEY: "the old log-probs before the advantages",
}
ENGINE_LOSS_MODES = ("vanilla", "sapo", "gpg", "dro", "cispo", "dppo_tv", "dppo_kl", "gspo", "geo_mean")
"""Loss modes the engine runs layout-invariantly: per-token ones, and gspo / geo_mean whose per-sequence
means are reduced over the SP group (``TrainEngine.sequence_sum``, ``loss_modes.ModeLoss``)."""
NOT_YET = "main_grpo does not run it yet (issue 30 item 2)"


@dataclass
class KLCtrlSection:
    """verl's ``algorithm.kl_ctrl``: the KL-in-reward coefficient controller."""

    type: str = "fixed"
    """fixed or adaptive."""
    kl_coef: float = 0.001
    """Initial (fixed: constant) coefficient of the KL penalty in the reward."""
    horizon: int = 10000
    """adaptive: the controller's horizon."""
    target_kl: float = 0.1
    """adaptive: the KL the controller steers to."""

    def __post_init__(self) -> None:
        check_choice("type", self.type, ("fixed", "adaptive"))


@dataclass
class FilterGroupsSection:
    """verl's ``algorithm.filter_groups`` (DAPO's dynamic sampling)."""

    enable: bool = False
    """Drop groups whose ``metric`` is the same for every response and sample more."""
    metric: str = "reward"
    """The per-response metric a group must vary in."""
    max_num_gen_batches: int = 0
    """Most generation batches per step (0 = no limit)."""
    max_inflight_gen_batches: int = 1
    """verl's async-generation bound."""


@dataclass
class AlgorithmSection:
    """verl's ``algorithm``: the advantage estimator and its settings."""

    adv_estimator: str = "grpo"
    """One of algorithms.ADV_ESTIMATOR_REGISTRY (verl's 14 estimators and drgrpo)."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide the group-relative advantages by the group's standard deviation (grpo, grpo_passk, gdpo)."""
    gamma: float = 1.0
    """Discount factor (gae, reinforce_plus_plus), in [0, 1]."""
    lam: float = 1.0
    """GAE lambda (adv_estimator=gae), in [0, 1]: 1 = Monte-Carlo returns, 0 = one-step TD."""
    gdpo_reward_keys: Optional[list] = None
    """gdpo: the reward function's extra fields to normalise separately (null = the score alone)."""
    gdpo_reward_weights: Optional[list] = None
    """gdpo: one weight per gdpo_reward_keys entry (null = all 1)."""
    use_kl_in_reward: bool = False
    """verl's KL penalty in the reward (refused when true: main_grpo does not run it yet)."""
    kl_penalty: str = "kl"
    """KL estimator of the in-reward penalty (with use_kl_in_reward)."""
    kl_ctrl: KLCtrlSection = field(default_factory=KLCtrlSection)
    """The in-reward KL coefficient's controller (with use_kl_in_reward)."""
    filter_groups: FilterGroupsSection = field(default_factory=FilterGroupsSection)
    """DAPO's dynamic sampling (enable=true is refused: main_grpo does not run it yet)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """verl's rollout-correction options (IS weights, rejection, bypass mode); refused when changed:
    main_grpo does not run them yet."""
    use_pf_ppo: bool = False
    """verl's prioritized-filtering PPO (refused when true: main_grpo does not run it)."""
    pf_ppo: dict = field(default_factory=lambda: {"reweight_method": "pow", "weight_pow": 2.0})
    """verl's pf_ppo settings (with use_pf_ppo)."""

    def __post_init__(self) -> None:
        check_choice("adv_estimator", self.adv_estimator, tuple(ADV_ESTIMATOR_REGISTRY))
        for key in ("gamma", "lam"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"{key}={getattr(self, key)} must be in [0, 1]")
        missing = [n for n in required_inputs(self.adv_estimator, self.advantage_params()) if n not in SUPPLIED_INPUTS]
        if missing:
            why = "; ".join(UNSUPPLIED_REASONS.get(n, n) for n in missing)
            raise ConfigError(
                f"adv_estimator={self.adv_estimator!r} needs {missing}: {why}; choose another estimator "
                f"(valid here: {sorted(supported_estimators())})"
            )
        if self.gdpo_reward_weights is not None and len(self.gdpo_reward_weights) != len(self.gdpo_reward_keys or ()):
            raise ConfigError(
                f"gdpo_reward_weights={list(self.gdpo_reward_weights)} needs one weight per gdpo_reward_keys entry "
                f"({list(self.gdpo_reward_keys or ())})"
            )
        self._refuse_unbuilt()

    def _refuse_unbuilt(self) -> None:
        """verl's keys of features not run here: accepted at verl's defaults, refused when changed."""
        changed = []
        if self.use_kl_in_reward:
            changed.append("use_kl_in_reward=true")
        if self.filter_groups.enable:
            changed.append("filter_groups.enable=true")
        if self.use_pf_ppo:
            changed.append("use_pf_ppo=true")
        default = RolloutCorrectionConfig()
        changed += [
            f"rollout_correction.{f.name}={getattr(self.rollout_correction, f.name)!r}"
            for f in fields(RolloutCorrectionConfig)
            if getattr(self.rollout_correction, f.name) != getattr(default, f.name)
        ]
        if changed:
            raise ConfigError(f"{', '.join(changed)}: {NOT_YET}; remove the override(s) to run without it")

    def advantage_params(self) -> AdvantageParams:
        """The estimators' settings."""
        return AdvantageParams(
            gamma=self.gamma,
            lam=self.lam,
            norm_adv_by_std_in_grpo=self.norm_adv_by_std_in_grpo,
            gdpo_reward_keys=tuple(self.gdpo_reward_keys) if self.gdpo_reward_keys else None,
            gdpo_reward_weights=tuple(self.gdpo_reward_weights) if self.gdpo_reward_weights else None,
        )

    @property
    def compares_group(self) -> bool:
        """Whether the estimator compares the responses to one prompt (needs rollout.n >= 2)."""
        return INDEX_KEY in required_inputs(self.adv_estimator, self.advantage_params())


def supported_estimators() -> list[str]:
    """The estimators whose every input this trainer supplies (with their default settings)."""
    return [
        name
        for name in ADV_ESTIMATOR_REGISTRY
        if all(n in SUPPLIED_INPUTS for n in required_inputs(name, AdvantageParams()))
    ]


@dataclass
class PolicyLossSection(LossModeKeys):
    """verl's ``actor_rollout_ref.actor.policy_loss`` (verl's names and defaults); ``loss_mode`` must be
    one of ENGINE_LOSS_MODES."""

    def __post_init__(self) -> None:
        check_choice("loss_mode", self.loss_mode, tuple(LOSS_MODE_REGISTRY))
        if self.loss_mode not in ENGINE_LOSS_MODES:
            raise ConfigError(
                f"loss_mode={self.loss_mode!r} needs a mini-batch-wide top-k or the rollout log-probs on the "
                f"update path, which {NOT_YET}; valid here: {list(ENGINE_LOSS_MODES)}"
            )


@dataclass
class ActorAlgorithmKeys:
    """The actor's algorithm keys beyond PolicyLossConfig's: ``policy_loss.*`` and SAPO's temperatures."""

    policy_loss: PolicyLossSection = field(default_factory=PolicyLossSection)
    """verl's policy-loss mode and its settings."""
    tau_pos: float = 1.0
    """sapo: gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """sapo: gate temperature for non-positive advantages."""

    def loss_mode_config(self) -> LossModeConfig:
        """The loss mode's own config, as the workers take it (errors name the policy_loss key)."""
        p = self.policy_loss
        values: dict[str, Any] = {f.name: getattr(p, f.name) for f in fields(LossModeKeys)}
        try:
            return LossModeConfig(**values, tau_pos=self.tau_pos, tau_neg=self.tau_neg)
        except ValueError as err:
            raise ConfigError(str(err)) from err

    def forced_agg_mode(self, loss_agg_mode: str) -> str:
        """The aggregation the loss mode runs with: sapo and geo_mean force seq-mean-token-mean, as verl does."""
        forced = LOSS_MODE_REGISTRY[self.policy_loss.loss_mode].agg_mode
        return forced if forced is not None else loss_agg_mode


__all__ = [
    "SEQ_MEAN_TOKEN_MEAN",
    "ActorAlgorithmKeys",
    "AlgorithmSection",
    "FilterGroupsSection",
    "KLCtrlSection",
    "PolicyLossSection",
    "supported_estimators",
]
