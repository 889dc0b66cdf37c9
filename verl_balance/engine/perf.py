"""Throughput metrics of a training step: tokens/s per device, MFU and peak device memory.

MFU = achieved model FLOPs / (step seconds * peak FLOPs of the device * devices), with the model
FLOPs from ``balance.workload.FlopsWorkload`` (forward FLOPs of the Llama-style decoder, causal
attention included; a training step counts 3x forward: backward is twice the forward) and the
dense bf16 tensor-core peak of the device from ``PEAK_BF16_FLOPS`` (the convention of verl and
torchtitan, also for fp32 parameters whose matmuls run in bf16 under mixed precision). Devices
that are not in the table, and CPUs, report tokens/s only.
"""

from __future__ import annotations

import torch

# Dense (no sparsity) bf16 peak FLOP/s by a substring of torch.cuda.get_device_name(); the first
# match wins, so more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
)

TRAIN_FLOPS_PER_FORWARD = 3.0


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` from PEAK_BF16_FLOPS; None for CPUs and unknown devices."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def step_perf_metrics(
    *, flops: float, tokens: float, seconds: float, world_size: int, device: torch.device
) -> dict[str, float]:
    """perf/* metrics of one step from its global model FLOPs and tokens and its wall seconds.

    perf/tokens_per_s_per_device = tokens / (seconds * world_size); perf/mfu where the device's
    peak is known; perf/max_memory_allocated_gb (peak since the last reset) on CUDA.
    """
    out = {"perf/tokens": float(tokens), "perf/step_seconds": float(seconds)}
    if seconds > 0:
        out["perf/tokens_per_s_per_device"] = tokens / (seconds * world_size)
        peak = peak_flops(device)
        if peak:
            out["perf/mfu"] = flops / (seconds * peak * world_size)
    if device.type == "cuda":
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return out
