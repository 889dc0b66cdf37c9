"""PPO's clipped value loss (verl's ``core_algos.compute_value_loss``) under the loss contract.

Per token, with v_old = wire ``values``, R = ``returns``, c = cliprange_value:
    loss = 0.5 * max((v - R)^2, (v_old + clamp(v - v_old, -c, c) - R)^2)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor

from verl_balance.batch_keys import RETURNS_KEY, VALUES_KEY


class ValueLossConfigError(ValueError):
    """A bad value-loss setting or a micro-batch without the keys the value loss reads."""


class ValueLossFn(Protocol):
    """Per-token loss of a value model for one micro-batch on this rank's SP slice."""

    def __call__(self, *, values: Tensor, inputs: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]: ...


def clipped_value_token_loss(
    *, vpreds: Tensor, old_values: Tensor, returns: Tensor, cliprange_value: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """(per-token clipped value loss, {vf_clipfrac, vpred_mean} per token); see the module docstring."""
    vclip = old_values + torch.clamp(vpreds - old_values, -cliprange_value, cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vclip - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return loss, {"vf_clipfrac": (clipped > unclipped).float(), "vpred_mean": vpreds.detach()}


class ValueLoss:
    """verl's clipped value loss as a ``ValueLossFn`` (wire keys ``values``, ``returns``)."""

    def __init__(self, *, cliprange_value: float):
        if not cliprange_value > 0:
            raise ValueLossConfigError(f"cliprange_value={cliprange_value!r} must be > 0")
        self.cliprange_value = float(cliprange_value)

    def required_keys(self) -> tuple[str, ...]:
        """Per-token wire tensors every micro-batch must carry."""
        return (VALUES_KEY, RETURNS_KEY)

    def __call__(self, *, values: Tensor, inputs: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        missing = [k for k in self.required_keys() if k not in inputs]
        if missing:
            raise ValueLossConfigError(f"micro-batch lacks {missing} needed by the value loss; it has {sorted(inputs)}")
        return clipped_value_token_loss(
            vpreds=values,
            old_values=inputs[VALUES_KEY].to(values.dtype),
            returns=inputs[RETURNS_KEY].to(values.dtype),
            cliprange_value=self.cliprange_value,
        )
