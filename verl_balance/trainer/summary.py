"""End-of-run summaries: the header both recipes share and, after a resume, the run's first values (and,
when the resumed process ran no step, its last ones) read back from ``metrics.jsonl``."""

from __future__ import annotations

import os

from verl_balance.utils.tracking import read_metrics

__all__ = ["recorded_ends", "summary_header"]


def _is_validation(record: dict) -> bool:
    return any(k.startswith("val/") for k in record)


def recorded_ends(metrics_path: str) -> dict:
    """A run's ``metrics.jsonl`` ends: ``first`` / ``last`` training record (step >= 1), ``first_val`` /
    ``last_val`` record with validation metrics and ``last_val_step``; {} / None where the file has none."""
    records = read_metrics(metrics_path) if os.path.exists(metrics_path) else []
    train = [r for r in records if r["step"] >= 1]
    val = [r for r in records if _is_validation(r)]
    return {
        "first": train[0] if train else {},
        "last": train[-1] if train else {},
        "first_val": val[0] if val else {},
        "last_val": val[-1] if val else {},
        "last_val_step": val[-1]["step"] if val else None,
    }


def summary_header(title: str, summary: dict) -> list[str]:
    """``==== <title> summary ====``, a line if a signal stopped the run early, and the step count with timings."""
    lines = ["", f"==== {title} summary ===="]
    if summary.get("stop_signal"):
        total = f" of {summary['total_steps']}" if summary.get("total_steps") else ""
        lines.append(
            f"interrupted ({summary['stop_signal']}) after step {summary['steps']}{total}: checkpoint saved, "
            "the same command resumes"
        )
    steps = f"steps: {summary['steps']} in {summary['wall_s']:.1f} s"
    if summary.get("startup_s") is not None:
        steps += f" (plus {summary['startup_s']:.1f} s start-up: cluster, model load, data)"
    if summary.get("resumed_from_step"):
        finished = summary["resumed_from_step"] == summary["steps"] == summary.get("total_steps")
        which = "the run had finished: values" if finished else "first values"
        steps += f"; resumed at step {summary['resumed_from_step']}, {which} from the metrics file"
    lines.append(steps)
    return lines
