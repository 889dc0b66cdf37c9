"""clip_cov and kl_cov through TrainEngine on dp=2 and sp=2, fixed and token-capped micro-batches (several
per rank) == a single-process reference whose covariance selection is over the whole mini-batch at once
(``reference_reductions`` on the (B, L) rows; verl's function on one micro-batch, test_loss_modes_verl.py).
clip_cov runs with k >= its candidates, where any uniform draw keeps all of them.

Negative control: an engine that selects per micro-batch and per rank (verl's statistics) differs from the
reference on dp=2.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.algorithms.test_ppo_loss_layouts import (
    LOSS_CONFIG,
    _ppo_batch,
    _reference_model,
    _run_case,
    _sequence_outputs,
)
from verl_balance.algorithms import LossModeConfig, policy_token_loss, reference_reductions
from verl_balance.algorithms.loss_modes import build_policy_loss
from verl_balance.distributed.launcher import run_on_ranks

MODES = [
    LossModeConfig(loss_mode="kl_cov", kl_cov_ratio=0.1, ppo_kl_coef=0.5),
    LossModeConfig(loss_mode="clip_cov", clip_cov_ratio=0.5, clip_cov_lb=0.05, clip_cov_ub=5.0),
]
KEYS = {"kl_cov": "kl_cov_select", "clip_cov": "clip_cov_drop"}
MICRO = ("fixed", "dynamic")


def _pad(rows, width):
    return torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])


def _reference(batch, mode: LossModeConfig) -> dict:
    """Token-mean loss and gradient norm with the whole mini-batch's selection, one forward per sequence."""
    model = _reference_model()
    outs = []
    for i in range(len(batch["input_ids"])):
        length = int(batch["attention_mask"][i].sum())
        aligned = {k: batch[k][i, 1:length] for k in ("old_log_probs", "ref_log_prob", "advantages", "loss_mask")}
        outs.append((*_sequence_outputs(model, batch["input_ids"][i, :length]), aligned))
    width = max(len(o[0]) for o in outs)
    reduced = reference_reductions(
        log_probs=_pad([o[0].detach() for o in outs], width),
        old_log_probs=_pad([o[2]["old_log_probs"] for o in outs], width),
        advantages=_pad([o[2]["advantages"] for o in outs], width),
        loss_mask=_pad([o[2]["loss_mask"] for o in outs], width),
        config=LOSS_CONFIG,
        mode=mode,
    )
    key = KEYS[mode.loss_mode]
    total, count, selected = 0.0, 0.0, float(reduced[key].sum())
    for i, (logp, entropy, aligned) in enumerate(outs):
        loss, _ = policy_token_loss(
            log_probs=logp,
            old_log_probs=aligned["old_log_probs"],
            advantages=aligned["advantages"],
            config=LOSS_CONFIG,
            mode=mode,
            reduced={key: reduced[key][i, : len(logp)]},
            ref_log_probs=aligned["ref_log_prob"],
            entropy=entropy,
        )
        total = total + (loss * aligned["loss_mask"]).sum()
        count += float(aligned["loss_mask"].sum())
    loss = total / count
    grads = [g for g in torch.autograd.grad(loss, list(model.parameters()), allow_unused=True) if g is not None]
    return {
        "loss": loss.item(),
        "grad_norm": float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))),
        "selected": selected,
    }


def _worker(rank, *, dp, sp, batch):
    from verl_balance.distributed import ParallelLayout
    from verl_balance.engine import TrainEngine

    class PerMicroBatchEngine(TrainEngine):
        """The fault: each micro-batch's statistics and top-k on its own rank (verl's); sp=1 only."""

        def _batch_selections(self, packed, *, loss_fn, temperature):
            out = []
            for p in packed:
                with torch.no_grad():
                    log_probs = self.forward_log_probs(p, temperature=temperature)[0]
                out += loss_fn.batch_selections(
                    log_probs=[log_probs],
                    inputs=[p.local_inputs()],
                    sequence_sums=[functools.partial(self.sequence_sum, p)],
                    seed=self.global_step,
                    num_tokens=int(p.tensors["loss_mask"].sum()),
                    world_sum=lambda t: t,
                    world_gather=lambda t: (t, 0),
                )
            return out

    layout = ParallelLayout(dp=dp, sp=sp, device_type="cpu")
    results = []
    for mode in MODES:
        for micro in MICRO:
            results.append(
                _run_case(
                    TrainEngine, layout, batch, micro, True, "token-mean", build_policy_loss(LOSS_CONFIG, mode=mode)
                )
            )
    if sp == 1:
        for mode in MODES:
            results.append(
                _run_case(
                    PerMicroBatchEngine,
                    layout,
                    batch,
                    "dynamic",
                    True,
                    "token-mean",
                    build_policy_loss(LOSS_CONFIG, mode=mode),
                )
            )
    return [(e["loss"], t["loss"], t["grad_norm"]) for e, t, _ in results]


@pytest.fixture(scope="module")
def batch():
    return _ppo_batch()


@pytest.fixture(scope="module")
def references(batch):
    return {m.loss_mode: _reference(batch, m) for m in MODES}


def test_reference_selections_are_non_trivial(batch, references):
    for mode in MODES:
        assert references[mode.loss_mode]["selected"] >= 2, mode.loss_mode


@pytest.mark.slow
@pytest.mark.parametrize("dp,sp", [(2, 1), (1, 2)])
def test_clip_cov_and_kl_cov_are_layout_invariant(batch, references, dp, sp):
    results = run_on_ranks(functools.partial(_worker, dp=dp, sp=sp, batch=batch), world=dp * sp)[0]
    cases = [(m, micro) for m in MODES for micro in MICRO]
    for (mode, micro), (evaluated, trained, grad_norm) in zip(cases, results):
        ref = references[mode.loss_mode]
        where = f"dp={dp} sp={sp} {micro} {mode.loss_mode}"
        assert evaluated == pytest.approx(ref["loss"], rel=1e-5), where
        assert trained == pytest.approx(ref["loss"], rel=1e-5), where
        assert grad_norm == pytest.approx(ref["grad_norm"], rel=1e-5), where
    if sp == 1:  # negative control: per-micro-batch statistics give another loss or gradient
        for mode, (_, trained, grad_norm) in zip(MODES, results[len(cases) :]):
            ref = references[mode.loss_mode]
            assert trained != pytest.approx(ref["loss"], rel=1e-5) or grad_norm != pytest.approx(
                ref["grad_norm"], rel=1e-5
            ), mode.loss_mode
