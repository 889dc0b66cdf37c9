"""A single-rank TrainEngine (world size 1) has nothing to compare or reduce: its step runs no
torch.distributed collective, and still matches the single-process reference (loss, grad norm,
parameters). Negative control: the same probe on a 2-rank group sees the collectives."""

import functools

import pytest
import torch
import torch.distributed as dist

from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.engine import MicroBatchError, TrainEngine
from verl_balance.parity import ParitySettings, make_global_batch, reference_steps

pytestmark = pytest.mark.slow  # spawns a process group

SETTINGS = ParitySettings(num_samples=6, seed=5)
COLLECTIVES = ("all_gather", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


def _counting_collectives(monkeypatch_calls: list) -> None:
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            monkeypatch_calls.append(_name)
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _step(rank: int, *, dp: int) -> dict:
    layout = ParallelLayout(dp=dp, sp=1, device_type="cpu")
    engine = TrainEngine(
        model_config=SETTINGS.model, engine_config=SETTINGS.engine_config(agg_mode="token-mean"), layout=layout
    )
    batch = make_global_batch(SETTINGS)
    rows = torch.arange(SETTINGS.num_samples).chunk(dp)[layout.dp_rank]
    micro_batches = [{k: v[idx] for k, v in batch.items()} for idx in rows.split(2)]
    calls: list = []
    _counting_collectives(calls)
    metrics = engine.train_batch(micro_batches)
    try:
        engine.eval_loss([])
        empty_error = None
    except MicroBatchError as err:
        empty_error = str(err)
    return {
        "calls": calls,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "params": engine.full_state_dict() if dp == 1 else None,
        "empty_error": empty_error,
    }


def test_single_rank_step_runs_no_collective_and_matches_the_reference():
    (out,) = run_on_ranks(functools.partial(_step, dp=1), world=1)
    assert out["calls"] == []
    reference = reference_steps(SETTINGS, agg_modes=["token-mean"])["token-mean"]
    assert out["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert out["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)
    for name, value in out["params"].items():
        torch.testing.assert_close(value, reference["params"][name], rtol=0, atol=1e-5)
    assert "at least one micro-batch" in out["empty_error"]


def test_negative_control_two_ranks_do_reduce():
    for out in run_on_ranks(functools.partial(_step, dp=2), world=2):
        assert "all_gather" in out["calls"] and "all_reduce" in out["calls"]
