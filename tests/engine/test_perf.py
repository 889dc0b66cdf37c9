"""perf/* metrics (MFU, tokens/s per device) and the CPU step timer, against hand-worked figures."""

import time

import numpy as np
import pytest
import torch

from verl_balance.balance.workload import FlopsWorkload
from verl_balance.engine import perf
from verl_balance.engine.timing import StepTimer
from verl_balance.models import ModelConfig


def test_mfu_is_model_flops_over_step_time_peak_and_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3e9)
    out = perf.step_perf_metrics(flops=989e12, tokens=8000, seconds=2.0, world_size=4, device=torch.device("cuda", 0))
    assert out["perf/mfu"] == pytest.approx(989e12 / (2.0 * 989e12 * 4))
    assert out["perf/tokens_per_s_per_device"] == pytest.approx(1000.0)
    assert out["perf/max_memory_allocated_gb"] == pytest.approx(3.0)


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
    ],
)
def test_peak_table_matches_the_most_specific_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert perf.peak_flops(torch.device("cuda", 0)) == peak


def test_cpu_and_unknown_devices_report_tokens_per_second_only(monkeypatch):
    out = perf.step_perf_metrics(flops=1e9, tokens=100, seconds=0.5, world_size=2, device=torch.device("cpu"))
    assert out["perf/tokens_per_s_per_device"] == pytest.approx(100.0)
    assert "perf/mfu" not in out and "perf/max_memory_allocated_gb" not in out
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert perf.peak_flops(torch.device("cuda", 0)) is None


def test_training_flops_are_three_forwards_of_the_workload_model():
    # Independent count for the tiny preset: 2 * params-in-matmuls per token plus causal attention.
    cfg = ModelConfig.preset("tiny")
    flops = FlopsWorkload.from_model_config(cfg)
    h, f, layers, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    d = cfg.head_dim if getattr(cfg, "head_dim", None) else h // cfg.num_heads
    matmul_params = layers * (2 * h * cfg.num_heads * d + 2 * h * cfg.num_kv_heads * d + 3 * h * f) + h * v
    length = 10
    forward = 2 * matmul_params * length + 4 * cfg.num_heads * d * layers * length * (length + 1) / 2
    assert float(flops.cost(np.array([length]))[0]) == pytest.approx(forward)
    assert perf.TRAIN_FLOPS_PER_FORWARD == 3.0


def test_cpu_step_timer_separates_busy_time_from_waiting():
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    time.sleep(0.05)  # waiting costs wall time, not CPU time
    timer.stop()
    timer.start()
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    timer.stop()
    times = timer.finish()
    assert len(times.wall) == len(times.busy) == 2
    assert times.wall[0] >= 0.05 and times.busy[0] < 0.02
    assert times.busy[1] >= 0.05
