"""tests/_adam.py's comparison of two engines' first AdamW step, on planted numbers: a rounding-level
gradient whose update flips between machines passes; an unexplained parameter change, a gradient that
differs beyond rounding, another start or a step that is not AdamW's fail."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from tests._adam import adam_direction, assert_same_adam_step

ADAM = {"lr": 1e-2, "eps": 1e-8, "weight_decay": 0.01}


def _run(start: np.ndarray, grad: np.ndarray) -> dict:
    after = start * (1 - ADAM["lr"] * ADAM["weight_decay"]) - ADAM["lr"] * adam_direction(grad, ADAM["eps"])
    return {"adam": dict(ADAM), "before": {"w": (start, grad)}, "after": {"w": (after.astype(np.float32), None)}}


@pytest.fixture
def reference() -> dict:
    rng = np.random.default_rng(0)
    grad = rng.normal(0, 1e-2, size=64)
    grad[0] = 0.05  # the tensor's scale: gradients compare to 1e-6 of it (5e-8)
    grad[7] = 1e-8  # at rounding level of that scale
    return _run(rng.normal(0, 0.1, size=64), grad)


def test_a_rounding_level_gradient_that_flips_the_update_passes(reference):
    start, grad = reference["before"]["w"]
    other = grad.copy()
    other[7] = -1e-8  # within rounding of the scale, yet the update moves by lr the other way
    ours = _run(start, other)
    assert abs(ours["after"]["w"][0][7] - reference["after"]["w"][0][7]) > ADAM["lr"] / 2
    assert_same_adam_step(ours, reference)


@pytest.mark.parametrize("plant", ["param", "grad", "start", "not_adam"])
def test_what_the_gradients_do_not_explain_fails(reference, plant):
    start, grad = reference["before"]["w"]
    ours = copy.deepcopy(reference)
    if plant == "param":  # the weights moved where the gradients agree
        ours["after"]["w"][0][3] += 1e-4 * ADAM["lr"] + 1e-5 * abs(ours["after"]["w"][0][3])
    elif plant == "grad":  # a gradient entry off by far more than float32 rounding
        ours = _run(start, np.where(np.arange(64) == 3, grad * 1.001, grad))
    elif plant == "start":
        ours = _run(start + np.where(np.arange(64) == 3, 1e-7, 0.0), grad)
    else:  # plain SGD on the same gradient
        ours["after"]["w"] = ((start - ADAM["lr"] * grad).astype(np.float32), None)
    with pytest.raises(AssertionError):
        assert_same_adam_step(ours, reference)
