"""End-of-run summaries: the header both recipes share and, after a resume, the run's first values
read back from ``metrics.jsonl`` (the process that resumed never saw them)."""

from __future__ import annotations

import os

from verl_balance.utils.tracking import read_metrics

__all__ = ["earliest_records", "summary_header"]


def earliest_records(metrics_path: str) -> tuple[dict, dict]:
    """(the first training record, the first validation record) of a run's ``metrics.jsonl``; {} where none."""
    if not os.path.exists(metrics_path):
        return {}, {}
    records = read_metrics(metrics_path)
    first = next((r for r in records if r["step"] >= 1), {})
    first_val = next((r for r in records if any(k.startswith("val/") for k in r)), {})
    return first, first_val


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
        steps += f"; resumed at step {summary['resumed_from_step']}, first values from the metrics file"
    lines.append(steps)
    return lines
