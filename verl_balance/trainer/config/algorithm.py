"""verl's RL-algorithm keys of the GRPO recipe: ``algorithm.*`` and ``actor_rollout_ref.actor.policy_loss.*``,
with verl's names, defaults and meanings.

Invariants:
- ``algorithm.adv_estimator`` is a name of ``ADV_ESTIMATOR_REGISTRY`` whose every input the trainer
  supplies (``SUPPLIED_INPUTS``); any other fails at start-up naming the key and the missing input.
- ``policy_loss.loss_mode`` is one of ``ENGINE_LOSS_MODES``; clip_cov / kl_cov select over the whole
  mini-batch, where verl selects per micro-batch.
- A feature not run here (``use_pf_ppo``) is refused naming the key, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from verl_balance.algorithms import ADV_ESTIMATOR_REGISTRY, LOSS_MODE_REGISTRY, AdvantageParams, LossModeConfig
from verl_balance.algorithms.estimator_inputs import AdvantageKeys
from verl_balance.algorithms.estimators import required_inputs
from verl_balance.algorithms.kl_in_reward import KL_CTRL_TYPES, KLController, build_kl_controller, in_reward_kl_type
from verl_balance.algorithms.loss_modes import SEQ_MEAN_TOKEN_MEAN, LossModeKeys
from verl_balance.algorithms.rollout_correction import RolloutCorrectionConfig
from verl_balance.batch_keys import INDEX_KEY, OLD_LOG_PROBS_KEY, SUM_PI_SQUARED_KEY, VALUES_KEY
from verl_balance.trainer.config.checks import ConfigError, check_choice

SUPPLIED_INPUTS = (
    INDEX_KEY,
    VALUES_KEY,
    "reward_baselines",
    "reward_components",
    OLD_LOG_PROBS_KEY,
    SUM_PI_SQUARED_KEY,
)
"""``AdvantageInputs`` fields the GRPO trainer supplies (uid, critic values, greedy baseline reward, reward
extras, old log-probs and sum of pi^2).
"""
ENGINE_LOSS_MODES = (
    "vanilla",
    "sapo",
    "gpg",
    "dro",
    "cispo",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "geo_mean",
    "clip_cov",
    "kl_cov",
    "bypass_mode",
)
"""Loss modes the engine runs layout-invariantly (per-sequence means reduced over the SP group,
covariance selection and bypass_mode normalisation over the whole mini-batch).
"""
NOT_YET = "main_grpo does not run it"


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
        check_choice("type", self.type, KL_CTRL_TYPES)
        if self.type == "adaptive" and not (self.horizon > 0 and self.target_kl > 0):
            raise ConfigError(
                f"horizon={self.horizon}, target_kl={self.target_kl}: type=adaptive needs both > 0 (verl's "
                "AdaptiveKLController divides by them)"
            )

    def controller(self) -> KLController:
        """verl's ``get_kl_controller``: the coefficient that steps update."""
        return build_kl_controller(type=self.type, kl_coef=self.kl_coef, target_kl=self.target_kl, horizon=self.horizon)


@dataclass
class FilterGroupsSection:
    """verl's ``algorithm.filter_groups`` (DAPO's dynamic sampling)."""

    enable: bool = False
    """Drop groups whose ``metric`` is the same for every response and sample more."""
    metric: str = "reward"
    """The per-response metric a group must vary in."""
    max_num_gen_batches: int = 0
    """Most generation batches per step (0 = no limit); batches are generated one at a time."""

    def __post_init__(self) -> None:
        if self.enable and not str(self.metric).strip():
            raise ConfigError("metric='' with enable=true: name the per-response metric (reward, acc, seq_reward, ...)")


@dataclass
class AlgorithmSection(AdvantageKeys):
    """verl's ``algorithm``: the advantage estimator, its settings (``AdvantageKeys``) and the steps
    around it."""

    adv_estimator: str = "grpo"
    """One of algorithms.ADV_ESTIMATOR_REGISTRY (verl's 14 estimators and drgrpo)."""
    use_kl_in_reward: bool = False
    """Subtract beta x KL(old || ref) per token from the rewards before the advantages (verl's apply_kl_penalty)."""
    kl_penalty: str = "kl"
    """KL estimator of the in-reward penalty: kl/k1, abs, mse/k2, low_var_kl/k3 (a '+' suffix is accepted)."""
    kl_ctrl: KLCtrlSection = field(default_factory=KLCtrlSection)
    """The in-reward KL coefficient's controller (with use_kl_in_reward)."""
    filter_groups: FilterGroupsSection = field(default_factory=FilterGroupsSection)
    """DAPO's dynamic sampling: groups whose metric is constant are dropped and more batches generated."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """verl's rollout correction: IS weights and rejection from the rollout's log-probs (decoupled), or
    bypass_mode (the rollout's log-probs are the old ones)."""
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
            raise ConfigError(
                f"adv_estimator={self.adv_estimator!r} needs {missing}, which the GRPO trainer does not supply; "
                "choose another estimator "
                f"(valid here: {sorted(supported_estimators())})"
            )
        if self.gdpo_reward_weights is not None and len(self.gdpo_reward_weights) != len(self.gdpo_reward_keys or ()):
            raise ConfigError(
                f"gdpo_reward_weights={list(self.gdpo_reward_weights)} needs one weight per gdpo_reward_keys entry "
                f"({list(self.gdpo_reward_keys or ())})"
            )
        try:
            in_reward_kl_type(self.kl_penalty)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self._refuse_unbuilt()

    def _refuse_unbuilt(self) -> None:
        """verl's values of features not run here: refused naming the key."""
        changed = []
        if self.use_pf_ppo:
            changed.append("use_pf_ppo=true")
        corr = self.rollout_correction
        if corr.bypass_mode and self.needs_sum_pi_squared:
            changed.append(
                f"adv_estimator={self.adv_estimator!r} with rollout_correction.bypass_mode=true (the estimator "
                "reads sum pi^2 from the old log-prob pass, which bypass mode skips; set bypass_mode=false)"
            )
        if changed:
            raise ConfigError(f"{', '.join(changed)}: {NOT_YET}; remove the override(s) to run without it")

    @property
    def corrects_rollout(self) -> bool:
        """Whether the step weights or rejects tokens by the rollout-vs-actor divergence (decoupled mode)."""
        corr = self.rollout_correction
        return not corr.bypass_mode and (corr.rollout_is is not None or corr.rollout_rs is not None)

    @property
    def needs_sum_pi_squared(self) -> bool:
        """The optimal-token baselines read the old log-prob pass's sum over the vocabulary of pi^2."""
        return SUM_PI_SQUARED_KEY in required_inputs(self.adv_estimator, self.advantage_params())

    @property
    def needs_old_log_probs_before_advantages(self) -> bool:
        """KL in the reward, the decoupled rollout correction and optimal-token baselines read old log-probs early."""
        return self.use_kl_in_reward or self.corrects_rollout or self.needs_sum_pi_squared

    def advantage_params(self) -> AdvantageParams:
        """The estimators' settings: this section's ``AdvantageKeys``."""
        return AdvantageParams(**{f.name: getattr(self, f.name) for f in fields(AdvantageKeys)})

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
    """verl's ``actor_rollout_ref.actor.policy_loss`` (verl's names and defaults); ``loss_mode`` must be one of
    ENGINE_LOSS_MODES. ``algorithm.rollout_correction.bypass_mode=true`` replaces these keys with the algorithm's."""

    def __post_init__(self) -> None:
        check_choice("loss_mode", self.loss_mode, tuple(LOSS_MODE_REGISTRY))
        if self.loss_mode not in ENGINE_LOSS_MODES:
            raise ConfigError(
                f"loss_mode={self.loss_mode!r}: the engine does not run it layout-invariantly; valid here: "
                f"{list(ENGINE_LOSS_MODES)}"
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

    def loss_mode_config(self, *, bypass: RolloutCorrectionConfig | None = None) -> LossModeConfig:
        """The loss mode's config as the workers take it (errors name the policy_loss key); ``bypass``: the
        algorithm's rollout correction, which makes the mode bypass_mode (verl's apply_bypass_mode)."""
        p = self.policy_loss
        values: dict[str, Any] = {f.name: getattr(p, f.name) for f in fields(LossModeKeys)}
        if bypass is not None:
            values.update(loss_mode="bypass_mode", rollout_correction=bypass)
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
