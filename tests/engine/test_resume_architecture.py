"""Resume refuses a checkpoint of another architecture, as warm start does (issue 50): a 4-layer
checkpoint loaded into a 2-layer engine (or one of other widths) is an ``EngineConfigError`` naming
the checkpoint and the first keys, on every rank, before anything is loaded. Negative control:
plain ``dcp.load`` of the 2-layer state from the 4-layer checkpoint succeeds and silently drops the
extra layers (what a resume did); the same architecture still loads exactly."""

import dataclasses
import functools
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.engine import TrainEngine
from verl_balance.engine.config import EngineConfigError
from verl_balance.engine.train_engine import checkpoint_state
from verl_balance.parity import ParitySettings

pytestmark = pytest.mark.slow  # spawns a process group

SETTINGS = ParitySettings(num_samples=4, seed=5)


def _engine(layout, **dims) -> TrainEngine:
    model = dataclasses.replace(SETTINGS.model, **dims)
    return TrainEngine(model_config=model, engine_config=SETTINGS.engine_config(agg_mode="token-mean"), layout=layout)


def _probe(rank: int, *, ckpt: str) -> dict:
    layout = ParallelLayout(dp=1, sp=1, device_type="cpu")
    four = _engine(layout, num_layers=4)
    four.save_checkpoint(ckpt, step=6)
    out = {}
    two = _engine(layout, num_layers=2)
    before = two.full_state_dict()
    try:
        two.load_checkpoint(ckpt)
    except EngineConfigError as err:
        out["refused"] = str(err)
    out["unchanged"] = all(torch.equal(two.full_state_dict()[k], v) for k, v in before.items())
    wide = _engine(layout, num_layers=4, intermediate_size=2 * SETTINGS.model.intermediate_size)
    try:
        wide.load_checkpoint(ckpt)
    except EngineConfigError as err:
        out["wider"] = str(err)
    # negative control: DCP itself loads the common keys of the 2-layer model and drops layers 2-3
    state = checkpoint_state(two.model, two.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": state["model"]}, checkpoint_id=ckpt)
    out["plain_dcp_loaded"] = True
    same = _engine(layout, num_layers=4)
    same.load_checkpoint(ckpt)
    out["same_exact"] = all(torch.equal(same.full_state_dict()[k], v) for k, v in four.full_state_dict().items())
    return out


def test_resume_refuses_a_checkpoint_of_another_architecture(tmp_path):
    (out,) = run_on_ranks(functools.partial(_probe, ckpt=str(tmp_path / "ckpt")), world=1)
    assert "does not fit this model" in out.get("refused", "") and "unexpected (" in out["refused"]
    assert "layers.2." in out["refused"] and str(tmp_path / "ckpt") in out["refused"]
    assert out["unchanged"]
    assert "shape mismatch" in out.get("wider", "")
    assert out["plain_dcp_loaded"] and out["same_exact"]
