"""Step-metric plumbing shared by the GRPO step's pieces: phase timers and means over optimizer steps."""

from __future__ import annotations

import contextlib
import time

import numpy as np


@contextlib.contextmanager
def timed(metrics: dict, name: str):
    """Add the wall seconds of the ``with`` body to ``metrics["timing_s/<name>"]``."""
    start = time.perf_counter()
    yield
    metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def mean_metrics(records: list[dict]) -> dict:
    """Key-wise mean over records (a key missing from a record is averaged over the others)."""
    keys = {k for r in records for k in r}
    return {k: float(np.mean([r[k] for r in records if k in r])) for k in sorted(keys)}


__all__ = ["mean_metrics", "timed"]
