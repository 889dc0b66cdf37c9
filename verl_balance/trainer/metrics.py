"""Driver-side metrics: per-rank engine results reduced to global figures, and a plan's
predicted balance."""

from __future__ import annotations

import numpy as np

PEAK_MEMORY_KEY = "perf/max_memory_allocated_gb"
# The engine's throughput figures (engine/perf.py), logged under their own names: the driver's
# perf/tokens and perf/tokens_per_s (whole driver step) are different figures and keep theirs.
ENGINE_PERF_KEYS = ("perf/mfu", "perf/tokens_per_s_per_device", PEAK_MEMORY_KEY)


def reduce_rank_metrics(per_rank: list[dict], *, prefix: str) -> dict:
    """Driver-side view of one engine call: global figures and measured per-rank timing.

    Engine metrics such as loss and grad_norm are already global (all-reduced over the mesh),
    so DP rank 0's value is taken, under ``prefix``; compute time differs per rank and gives
    the measured imbalance (``measured_balance_metrics``). The engine's ENGINE_PERF_KEYS keep
    their names: MFU and tokens/s per device are the same on every rank, the peak memory is the
    maximum over ranks.
    """
    out = {}
    for key, value in per_rank[0].items():
        if key in ENGINE_PERF_KEYS:
            out[key] = float(value)
        elif isinstance(value, (int, float, bool)) and key != "dp_rank" and not key.endswith("seconds"):
            out[prefix + key] = float(value)
    peak_memory = [m[PEAK_MEMORY_KEY] for m in per_rank if PEAK_MEMORY_KEY in m]
    if peak_memory:
        out[PEAK_MEMORY_KEY] = float(max(peak_memory))
    out.update(measured_balance_metrics(busy_seconds(per_rank)))
    return out


def busy_seconds(per_rank: list[dict]) -> np.ndarray:
    """Each rank's busy seconds of one engine call: its own compute, without the time it waited in
    collectives for slower ranks (engine/timing.py); a rank that only waited counts 0."""
    return np.array([m.get("busy_seconds", 0.0) for m in per_rank], dtype=np.float64)


def measured_balance_metrics(busy: np.ndarray) -> dict:
    """``balance/imbalance_measured`` (max / mean over ranks of the per-rank busy seconds) and
    ``timing_s/busy_max|mean``; nothing when no rank was busy. The one definition of the measured
    imbalance: SFT passes one engine call's ``busy_seconds``, GRPO their sum over a step's updates."""
    if not busy.size or busy.mean() <= 0:
        return {}
    return {
        "balance/imbalance_measured": float(busy.max() / busy.mean()),
        "timing_s/busy_max": float(busy.max()),
        "timing_s/busy_mean": float(busy.mean()),
    }


def plan_metrics(plan) -> dict:
    """Predicted balance of the plan and of the naive contiguous split, from the plan's stats."""
    s = plan.stats
    out = {
        "balance/imbalance_predicted": float(s["imbalance"]),
        "balance/imbalance_predicted_naive": float(s["naive_imbalance"]),
        "balance/sync_ratio_predicted": float(s["sync_ratio"]),
        "balance/sync_ratio_predicted_naive": float(s["naive_sync_ratio"]),
        "balance/num_micro_batches": float(s["num_micro_batches"]),
        "balance/num_micro_batches_naive": float(s["naive_num_micro_batches"]),
    }
    if s.get("num_skipped") or s.get("num_truncated"):
        out["balance/skipped"] = float(s["num_skipped"])
        out["balance/truncated"] = float(s["num_truncated"])
    return out
