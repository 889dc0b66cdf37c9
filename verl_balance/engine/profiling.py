"""torch.profiler traces of chosen train steps on every rank.

Set ``EngineConfig.profile_steps`` (1-based train steps) and ``profile_dir``; the engine wraps
those train_batch calls in ``step_profiler`` and writes
``<profile_dir>/step_<N>/rank_<R>.trace.json`` on every rank: open it in Perfetto
(ui.perfetto.dev) or chrome://tracing. CPU activity is always recorded, CUDA kernels as well on
GPUs; shapes are recorded, Python stacks are not (they make traces large and slow to write).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def step_profiler(
    *, enabled: bool, out_dir: str, step: int, rank: int, device: torch.device
) -> Iterator[torch.profiler.profile | None]:
    """Profile the block into out_dir/step_<step>/rank_<rank>.trace.json when ``enabled``."""
    if not enabled:
        yield None
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        yield prof
    path = os.path.join(out_dir, f"step_{step}", f"rank_{rank}.trace.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    prof.export_chrome_trace(path)
    logger.info("profiler trace of step %d, rank %d -> %s", step, rank, path)
