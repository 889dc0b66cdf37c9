"""Measure what a TrainEngine rank holds: bytes of its live parameter / gradient / optimizer-state
tensors (this rank's local shards) and its process's peak RSS during a block.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def local_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients (those set) and optimizer state tensors."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(g) for g in grads),
        "optimizer": sum(_local_bytes(v) for v in state),
    }


def _rss_bytes() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class PeakRSS:
    """Peak RSS growth of this process inside a ``measure()`` block: sampled by a thread (psutil,
    every ``interval_s``) and, on Linux, the kernel's VmHWM after resetting it (exact)."""

    def __init__(self, *, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.baseline = 0
        self.sampled_peak = 0
        self.hwm_peak: int | None = None

    @property
    def sampled_growth(self) -> int:
        return self.sampled_peak - self.baseline

    @property
    def hwm_growth(self) -> int | None:
        return None if self.hwm_peak is None else self.hwm_peak - self.baseline

    @contextlib.contextmanager
    def measure(self) -> Iterator[PeakRSS]:
        stop = threading.Event()
        self.baseline = self.sampled_peak = _rss_bytes()
        hwm_ok = _reset_hwm()

        def sample() -> None:
            while not stop.is_set():
                self.sampled_peak = max(self.sampled_peak, _rss_bytes())
                stop.wait(self.interval_s)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.sampled_peak = max(self.sampled_peak, _rss_bytes())
            self.hwm_peak = _hwm_bytes() if hwm_ok else None
