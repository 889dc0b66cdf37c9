"""The advantage-estimator registry: verl's ``algorithm.adv_estimator`` names (plus our drgrpo),
each with the batch inputs it needs, so a trainer checks them at start-up.

Invariants:
- ``check_estimator`` fails naming ``algorithm.adv_estimator`` for an unknown name or an input the
  trainer cannot supply.
- Every estimator returns (B, L) float32 tensors, 0 outside ``response_mask``, equal to verl's on
  the response slice except where ``advantages.py`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from verl_balance.algorithms import outcome_estimators as outcome
from verl_balance.algorithms import token_estimators as token
from verl_balance.algorithms.estimator_inputs import AdvantageInputs, AdvantageOutput, AdvantageParams
from verl_balance.algorithms.group_stats import AdvantageInputError
from verl_balance.batch_keys import INDEX_KEY, OLD_LOG_PROBS_KEY, ROLLOUT_IS_WEIGHTS_KEY, SUM_PI_SQUARED_KEY, VALUES_KEY

ESTIMATOR_KEY = "algorithm.adv_estimator"


@dataclass(frozen=True)
class EstimatorSpec:
    """One registry entry: the function and the optional inputs it reads."""

    fn: Callable[..., AdvantageOutput]
    inputs: tuple[str, ...]
    """Optional ``AdvantageInputs`` fields the estimator needs (besides rewards and the response mask)."""
    optional_inputs: tuple[str, ...] = ()
    """Fields it uses when present."""


_GROUP = (INDEX_KEY,)
_OTB = (INDEX_KEY, OLD_LOG_PROBS_KEY, SUM_PI_SQUARED_KEY)

ADV_ESTIMATOR_REGISTRY: dict[str, EstimatorSpec] = {
    "gae": EstimatorSpec(token.gae, (VALUES_KEY,)),
    "grpo": EstimatorSpec(outcome.grpo, _GROUP),
    "drgrpo": EstimatorSpec(outcome.drgrpo, _GROUP),
    "rloo": EstimatorSpec(outcome.rloo, _GROUP),
    "reinforce_plus_plus": EstimatorSpec(token.reinforce_plus_plus, ()),
    "reinforce_plus_plus_baseline": EstimatorSpec(outcome.reinforce_plus_plus_baseline, _GROUP),
    "remax": EstimatorSpec(token.remax, ("reward_baselines",)),
    "opo": EstimatorSpec(outcome.opo, _GROUP),
    "grpo_passk": EstimatorSpec(outcome.grpo_passk, _GROUP),
    "gpg": EstimatorSpec(outcome.gpg, _GROUP),
    "rloo_vectorized": EstimatorSpec(outcome.rloo, _GROUP),
    "grpo_vectorized": EstimatorSpec(outcome.grpo, _GROUP),
    "optimal_token_baseline": EstimatorSpec(token.optimal_token_baseline, _OTB, (ROLLOUT_IS_WEIGHTS_KEY,)),
    "tir_optimal_token_baseline": EstimatorSpec(token.tir_optimal_token_baseline, _OTB, (ROLLOUT_IS_WEIGHTS_KEY,)),
    "gdpo": EstimatorSpec(outcome.gdpo, _GROUP, ("reward_components",)),
}
"""verl's 14 estimators and our drgrpo (= grpo with norm_adv_by_std_in_grpo=false)."""


def estimator_spec(adv_estimator: str) -> EstimatorSpec:
    """The registry entry, or an error naming ``algorithm.adv_estimator`` and the valid names."""
    spec = ADV_ESTIMATOR_REGISTRY.get(adv_estimator)
    if spec is None:
        raise AdvantageInputError(
            f"{ESTIMATOR_KEY}={adv_estimator!r} is not an estimator; valid: {sorted(ADV_ESTIMATOR_REGISTRY)}"
        )
    return spec


def required_inputs(adv_estimator: str, params: AdvantageParams | None = None) -> tuple[str, ...]:
    """The optional inputs needed with these settings (gdpo with ``gdpo_reward_keys``: ``reward_components``)."""
    spec = estimator_spec(adv_estimator)
    extra = ("reward_components",) if adv_estimator == "gdpo" and params and params.gdpo_reward_keys else ()
    return spec.inputs + extra


def check_estimator(adv_estimator: str, *, available: Iterable[str], params: AdvantageParams | None = None) -> None:
    """Raise naming ``algorithm.adv_estimator`` when a needed input is not in ``available``."""
    missing = [name for name in required_inputs(adv_estimator, params) if name not in set(available)]
    if missing:
        raise AdvantageInputError(
            f"{ESTIMATOR_KEY}={adv_estimator!r} needs {missing}, which this trainer does not provide "
            f"(it provides {sorted(set(available))})"
        )


def compute_advantage(*, adv_estimator: str, inputs: AdvantageInputs, params: AdvantageParams) -> AdvantageOutput:
    """Run one registered estimator after checking its inputs and the tensor shapes."""
    check_estimator(adv_estimator, available=inputs.available(), params=params)
    shape = tuple(inputs.response_mask.shape)
    if len(shape) != 2 or tuple(inputs.token_level_rewards.shape) != shape:
        raise AdvantageInputError(
            f"token_level_rewards {tuple(inputs.token_level_rewards.shape)} and response_mask {shape} must be the "
            f"same (B, L)"
        )
    for name in (VALUES_KEY, OLD_LOG_PROBS_KEY, SUM_PI_SQUARED_KEY, ROLLOUT_IS_WEIGHTS_KEY):
        tensor = getattr(inputs, name)
        if tensor is not None and tuple(tensor.shape) != shape:
            raise AdvantageInputError(f"{name} has shape {tuple(tensor.shape)}; it must be (B, L) = {shape}")
    return estimator_spec(adv_estimator).fn(inputs=inputs, params=params)
