"""Per-micro-batch timing that never stalls the device queue.

CPU: wall time (perf_counter) and this process's CPU time (process_time) around each
micro-batch. A blocking gloo wait costs no CPU time, so the CPU figure is the rank's own work
("busy"), free of waits for slower ranks.

CUDA: a pair of timing events per micro-batch is recorded on the current stream and read once,
when the step ends (one wait for the last event per step, instead of a torch.cuda.synchronize per
micro-batch that keeps the host from queueing the next micro-batch's kernels). Event time is the
span of the micro-batch's kernels on the compute stream; it includes the stream's waits on
FSDP's all-gather/reduce-scatter streams, so on accelerators busy time still contains some
collective waiting (the host cannot separate it without per-kernel tracing: use the profiler).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


@dataclass
class MicroBatchTimes:
    """The measured times of one step's micro-batches, in seconds."""

    wall: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)


class StepTimer:
    """Times the micro-batches of one step on ``device``; read with ``finish()`` once."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host: list[tuple[float, float, float, float]] = []
        self._open: tuple | None = None

    def start(self) -> None:
        """Mark the start of a micro-batch (no device wait)."""
        assert self._open is None, "StepTimer.start twice without stop"
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._open = (event,)
        else:
            self._open = (time.perf_counter(), time.process_time())

    def stop(self) -> None:
        """Mark the end of the micro-batch opened by start() (no device wait)."""
        assert self._open is not None, "StepTimer.stop without start"
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._events.append((self._open[0], event))
        else:
            self._host.append((*self._open, time.perf_counter(), time.process_time()))
        self._open = None

    def finish(self) -> MicroBatchTimes:
        """Per-micro-batch wall and busy seconds; on CUDA waits once for the last event."""
        assert self._open is None, "StepTimer.finish inside a micro-batch"
        if self._cuda:
            if self._events:
                self._events[-1][1].synchronize()
            wall = [start.elapsed_time(end) / 1e3 for start, end in self._events]
            return MicroBatchTimes(wall=wall, busy=list(wall))
        return MicroBatchTimes(
            wall=[w1 - w0 for w0, _, w1, _ in self._host], busy=[c1 - c0 for _, c0, _, c1 in self._host]
        )
