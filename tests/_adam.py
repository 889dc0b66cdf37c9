"""Comparing two engines' AdamW steps without a machine-dependent tolerance.

Parameters after an optimizer step are not comparable at a fixed rtol: Adam's first update is
``lr * g / (|g| + eps)``, about ``lr * sign(g)``, so an entry whose gradient is at rounding level
moves by up to ``lr`` on one CPU and not on another. These helpers record each trainable parameter
and its gradient just before ``optimizer.step()`` (a step pre-hook) and after it; the comparison is
then: the same start, the same gradients (float32 rounding of the tensor's scale), each engine's
step equal to AdamW's first step from its own gradient, and the two results apart by no more than
the two gradients explain through that step.
"""

from __future__ import annotations

import numpy as np


def _full(t):
    """A DTensor's full value (a collective: every rank calls it), a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def trainable_state(module, *, rename=lambda name: name) -> dict:
    """{rename(name): (parameter, gradient or None)} of ``module``'s trainable parameters, in float64."""
    out = {}
    for name, p in module.named_parameters():
        if p.requires_grad:
            grad = None if p.grad is None else _full(p.grad).detach().double().cpu().numpy().copy()
            out[rename(name)] = (_full(p).detach().double().cpu().numpy().copy(), grad)
    return out


def record_step(optimizer, module, *, rename=lambda name: name) -> dict:
    """A dict that ``optimizer.step()`` fills with ``trainable_state`` just before it runs, and
    ``adam`` (lr, eps, weight_decay of the first group). Read ``after`` yourself once the step is done."""
    recorded: dict = {}

    def before_step(*_):
        group = optimizer.param_groups[0]
        recorded["adam"] = {key: group[key] for key in ("lr", "eps", "weight_decay")}
        recorded["before"] = trainable_state(module, rename=rename)

    optimizer.register_step_pre_hook(before_step)
    return recorded


def adam_direction(grad: np.ndarray, eps: float) -> np.ndarray:
    """AdamW's first update per unit of lr: bias-corrected m = g and v = g**2, so g / (|g| + eps)."""
    return grad / (np.abs(grad) + eps)


def assert_same_adam_step(ours: dict, reference: dict, *, grad_rtol: float = 1e-5) -> None:
    """``ours`` and ``reference`` ({"adam", "before", "after"} from ``record_step`` plus
    ``trainable_state`` after the step) took the same first AdamW step, up to float32 rounding."""
    assert ours["adam"] == reference["adam"]
    lr, eps, decay = (ours["adam"][key] for key in ("lr", "eps", "weight_decay"))
    assert sorted(ours["before"]) == sorted(reference["before"]) == sorted(ours["after"]) == sorted(reference["after"])
    for name, (start, grad) in ours["before"].items():
        ref_start, ref_grad = reference["before"][name]
        np.testing.assert_array_equal(start, ref_start, err_msg=name)  # the same initial weights
        assert grad is not None and ref_grad is not None, name
        scale = np.abs(ref_grad).max()
        np.testing.assert_allclose(grad, ref_grad, rtol=grad_rtol, atol=grad_rtol * 0.1 * scale, err_msg=name)
        for run, g in ((ours, grad), (reference, ref_grad)):  # each engine took AdamW's first step
            want = start * (1 - lr * decay) - lr * adam_direction(g, eps)
            np.testing.assert_allclose(run["after"][name][0], want, rtol=1e-5, atol=lr * 1e-5, err_msg=name)
        # Ours against the reference, per entry: float32 rounding plus what the gradient difference moves.
        explained = lr * np.abs(adam_direction(grad, eps) - adam_direction(ref_grad, eps))
        gap = np.abs(ours["after"][name][0] - reference["after"][name][0])
        bound = explained + 1e-5 * np.abs(reference["after"][name][0]) + lr * 1e-5
        assert (gap <= bound).all(), (name, float((gap - bound).max()))
