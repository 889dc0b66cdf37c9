"""verl's fsdp_config.param_offload / optimizer_offload / offload_policy: FSDP2's CPUOffloadPolicy is
passed to every fully_shard when the engine runs on CUDA; on CPU workers the switches have no effect
and are named in a log line. (The CUDA run itself needs a GPU: docs/performance.md.)"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy

from verl_balance.distributed import ParallelLayout
from verl_balance.engine import EngineConfig, TrainEngine, materialize
from verl_balance.engine.config import FSDPConfig
from verl_balance.engine.offload import OFFLOAD_SWITCHES, cpu_offload_policy
from verl_balance.models.config import ModelConfig


@pytest.mark.parametrize("switch", OFFLOAD_SWITCHES)
def test_each_switch_gives_cpu_offload_on_cuda_only(switch, caplog):
    fsdp = FSDPConfig(**{switch: True})
    assert isinstance(cpu_offload_policy(fsdp, device_type="cuda"), CPUOffloadPolicy)
    with caplog.at_level(logging.INFO, logger="verl_balance.engine.offload"):
        assert cpu_offload_policy(fsdp, device_type="cpu", log=True) is None
    assert f"fsdp_config.{switch}: no effect on cpu workers" in caplog.text


def test_no_switch_means_no_policy_on_any_device():
    for device in ("cuda", "cpu"):
        assert cpu_offload_policy(FSDPConfig(), device_type=device) is None


class _TwoUnits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def fsdp_units(self):
        return [self.a, self.b]


@pytest.mark.parametrize("policy", [CPUOffloadPolicy(pin_memory=True), None])
def test_shard_model_passes_the_policy_to_every_fully_shard(monkeypatch, policy):
    calls = []
    monkeypatch.setattr(materialize, "fully_shard", lambda module, **kwargs: calls.append((module, kwargs)))
    model = _TwoUnits()
    materialize.shard_model(
        model, mesh="mesh", param_dtype=torch.float32, reshard_after_forward=True, offload_policy=policy
    )
    assert [m for m, _ in calls] == [model.a, model.b, model]
    if policy is None:  # FSDP2's own default (no offload): the argument is not passed
        assert all("offload_policy" not in kw for _, kw in calls)
    else:
        assert all(kw["offload_policy"] is policy for _, kw in calls)


def test_a_cpu_engine_with_offload_set_runs_as_without_it(caplog):
    model = ModelConfig.preset("tiny").__class__(**{**ModelConfig.preset("tiny").to_dict(), "vocab_size": 64})
    layout = ParallelLayout(dp=1, sp=1, device_type="cpu")
    with caplog.at_level(logging.INFO, logger="verl_balance.engine.offload"):
        offloaded = TrainEngine(
            model_config=model, engine_config=EngineConfig(fsdp=FSDPConfig(param_offload=True)), layout=layout
        )
    plain = TrainEngine(model_config=model, engine_config=EngineConfig(), layout=layout)
    assert offloaded.sharded is plain.sharded is False
    assert "fsdp_config.param_offload: no effect on cpu workers" in caplog.text
    for (name, p), q in zip(offloaded.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(p, q), name  # the same model, nothing moved
