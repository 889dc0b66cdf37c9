"""TrainEngine's public micro-batch API, driven by hand as an external loop (verl's engine backend)
does, takes the same step as ``train_batch`` / ``eval_loss`` on the same micro-batches.

The hand loop's loss is written out here (token-mean: loss-mask tokens over the global count taken
from the wire tensors, log-softmax + gather), independent of ``loss.compute_token_weights``. Negative
controls: never signalling the last micro-batch to ``prepare_backward`` (gradients stay unreduced
under ``defer_gradient_sync``) and dropping the gradient divide factor G from the backward.
"""

import dataclasses
import functools

import pytest
import torch

from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.engine import TrainEngine
from verl_balance.engine.config import FSDPConfig
from verl_balance.parity import ParitySettings, make_global_batch
from verl_balance.testing.faults import FaultyTrainEngine

SETTINGS = ParitySettings(num_samples=8, seed=7)
# Two micro-batches per DP rank (sample 1 has no loss tokens at all).
RANK_SAMPLES = {0: [[0, 1], [2, 3]], 1: [[4, 5, 6], [7]]}
# Every FSDP2 gradient-accumulation control on, so prepare_backward's is_last decides when gradients
# are reduce-scattered and parameters resharded.
DEFERRED = FSDPConfig(reshard_after_forward=False, reshard_after_backward=False, defer_gradient_sync=True)


def _micro_batches(dp_rank: int) -> list[dict[str, torch.Tensor]]:
    batch = make_global_batch(SETTINGS)
    return [{k: v[torch.tensor(idx)] for k, v in batch.items()} for idx in RANK_SAMPLES[dp_rank]]


def _global_loss_tokens(micro_batches) -> float:
    """Loss-mask tokens of the whole mini-batch from the wire: token t >= 1 inside the attention mask
    (SUM over the world = the DP group here, sp = 1)."""
    import torch.distributed as dist

    local = sum(float((mb["loss_mask"][:, 1:] * mb["attention_mask"][:, 1:]).sum()) for mb in micro_batches)
    total = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total)


def _params(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return engine.full_state_dict()


def _hand_step(engine: TrainEngine, micro_batches, *, training: bool, skip_last: bool = False, scale=None) -> dict:
    """One step (or an eval pass) through the public API with this module's own token-mean loss."""
    import torch.distributed as dist

    num_tokens = _global_loss_tokens(micro_batches)
    scale = float(engine.gradient_divide_factor) if scale is None else scale
    engine.check_micro_batches(micro_batches)
    packed = engine.pack_micro_batches(micro_batches, require_loss_mask=True)
    engine.model.train(training)
    if training:
        engine.zero_grad()
    loss = torch.zeros((), dtype=torch.float64)
    for k, p in enumerate(packed):
        if training:
            engine.prepare_backward(is_last=(k == len(packed) - 1) and not skip_last)
        with torch.set_grad_enabled(training):
            logits = engine.forward_logits(p).float()
            log_probs = torch.log_softmax(logits, dim=-1).gather(-1, p.local("targets").long()[:, None])[:, 0]
            objective = -(p.local("loss_mask") * log_probs).sum() / num_tokens
            if training:
                (objective * scale).backward()
        loss += objective.detach().double()
    if not training:
        engine.reshard()
    dist.all_reduce(loss)
    out = {"loss": float(loss)}
    if training:
        out.update(engine.optimizer_step())
        out["lr_after"] = engine.advance_schedule()
        out["global_step"] = engine.global_step
    out["params"] = _params(engine)
    return out


def _scenarios(rank: int) -> dict:
    layout = ParallelLayout(dp=2, sp=1, device_type="cpu")
    config = dataclasses.replace(SETTINGS.engine_config(agg_mode="token-mean"), fsdp=DEFERRED)
    mbs = _micro_batches(layout.dp_rank)

    def engine() -> TrainEngine:
        return TrainEngine(model_config=SETTINGS.model, engine_config=config, layout=layout)

    reference = engine()
    out = {"gradient_divide_factor": reference.gradient_divide_factor, "initial": _params(reference)}
    out["ref_eval"] = reference.eval_loss(mbs)["loss"]
    ref = reference.train_batch(mbs)
    out["ref"] = {
        "loss": ref["loss"],
        "grad_norm": ref["grad_norm"],
        "lr_after": reference.scheduler.get_last_lr()[0],
        "global_step": reference.global_step,
        "params": _params(reference),
    }
    hand = engine()
    out["hand_eval"] = _hand_step(hand, mbs, training=False)["loss"]
    out["hand"] = _hand_step(hand, mbs, training=True)
    out["skip_last"] = _hand_step(engine(), mbs, training=True, skip_last=True)
    out["no_divide_factor"] = _hand_step(engine(), mbs, training=True, scale=1.0)
    return out


@functools.cache
def _results() -> list[dict]:
    return run_on_ranks(_scenarios, world=2)


def _max_param_delta(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_hand_driven_public_api_step_equals_train_step_loss_grad_norm_and_params():
    for r in _results():
        assert r["gradient_divide_factor"] == 2  # FSDP2 averages over W = 2 ranks
        ref, hand = r["ref"], r["hand"]
        assert hand["loss"] == pytest.approx(ref["loss"], rel=1e-6)
        assert hand["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-6)
        assert hand["step_skipped"] is False
        assert (hand["lr_after"], hand["global_step"]) == (ref["lr_after"], ref["global_step"])
        # Adam's first step divides each gradient element by its own magnitude, so fp32 noise in the
        # smallest gradients reaches the weights at ~1e-6; the controls below move them by > 1e-4.
        assert _max_param_delta(hand["params"], ref["params"]) < 1e-5
        # The step moved the weights: equal parameters are not the trivial "nothing happened".
        assert _max_param_delta(r["initial"], ref["params"]) > 1e-4


@pytest.mark.slow
def test_hand_driven_forward_only_pass_with_reshard_equals_eval_loss():
    for r in _results():
        assert r["hand_eval"] == pytest.approx(r["ref_eval"], rel=1e-6)
        assert r["hand_eval"] == pytest.approx(r["ref"]["loss"], rel=1e-6)  # same weights before the step


@pytest.mark.slow
def test_negative_control_never_signalling_the_last_micro_batch_leaves_gradients_unreduced():
    for r in _results():
        # The loss is computed before any reduction, so it still agrees; the gradient never reaches
        # the sharded parameters, so the norm and the step differ.
        assert r["skip_last"]["loss"] == pytest.approx(r["ref"]["loss"], rel=1e-6)
        assert r["skip_last"]["grad_norm"] != pytest.approx(r["ref"]["grad_norm"], rel=1e-3)
        assert _max_param_delta(r["skip_last"]["params"], r["ref"]["params"]) > 1e-4


@pytest.mark.slow
def test_negative_control_backward_without_the_gradient_divide_factor_is_off_by_g():
    for r in _results():
        assert r["no_divide_factor"]["loss"] == pytest.approx(r["ref"]["loss"], rel=1e-6)
        assert r["no_divide_factor"]["grad_norm"] == pytest.approx(r["ref"]["grad_norm"] / 2, rel=1e-6)


def test_pack_micro_batches_runs_through_the_fault_injection_seam():
    """The public method delegates to ``_pack``, which testing.faults overrides (so an injected fault
    reaches every caller of the public API, the verl backend included)."""
    calls = []

    class Seam:
        def _pack(self, micro_batches, *, require_loss_mask):
            calls.append((micro_batches, require_loss_mask))
            return ["packed"]

    wire = [{"input_ids": torch.ones(1, 3, dtype=torch.long), "attention_mask": torch.ones(1, 3)}]
    assert TrainEngine.pack_micro_batches(Seam(), wire, require_loss_mask=False) == ["packed"]
    assert calls == [(wire, False)]
    assert FaultyTrainEngine._pack is not TrainEngine._pack
    assert FaultyTrainEngine.pack_micro_batches is TrainEngine.pack_micro_batches
