"""Plot loss, imbalance and reward curves of one or more runs (metrics.jsonl) to one PNG.

``python -m verl_balance.utils.plotting RUN_DIR [RUN_DIR ...] --out curves.png``

Runs are overlaid on the same axes, line width shrinking with the run's position so identical
curves stay visible.
"""

from __future__ import annotations

import argparse
import io
import os
import re
from collections.abc import Sequence

from .atomic_io import atomic_write_bytes
from .tracking import METRICS_FILE, read_metrics

DEFAULT_PANELS: tuple[tuple[str, str], ...] = (
    ("loss", r"(^|[/_])loss$"),
    ("imbalance (1.0 = perfectly balanced)", r"imbalance"),
    ("reward / accuracy", r"(^|/)(reward|score|acc|accuracy)(/|_|$)"),
)
LINE_STYLES = ("-", "--", ":", "-.")


def run_label(path: str) -> str:
    """The run directory's name (of ``path``, a run directory or its metrics file)."""
    return run_labels([path])[0]


def run_labels(paths: Sequence[str]) -> list[str]:
    """One label per run: its directory's name, or as many trailing path parts as tell the runs apart."""
    dirs = [os.path.normpath(os.path.abspath(os.path.dirname(p) if p.endswith(".jsonl") else p)) for p in paths]
    parts = [d.split(os.sep) for d in dirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return labels


def _numeric_keys(records: Sequence[list[dict]]) -> list[str]:
    """Sorted names of the numeric metrics in any run (``step`` and ``time`` excluded)."""
    return sorted(
        {
            k
            for recs in records
            for r in recs
            for k, v in r.items()
            if k not in ("step", "time") and isinstance(v, (int, float))
        }
    )


def _panel_keys(
    runs: Sequence[str], series_keys: list[str], panels: Sequence[tuple[str, str]]
) -> list[tuple[str, list[str]]]:
    """(panel name, the metric names its regex matches) for each panel matching any metric."""
    drawn = [(name, [k for k in series_keys if re.search(pattern, k)]) for name, pattern in panels]
    drawn = [(name, keys) for name, keys in drawn if keys]
    if not drawn:
        raise ValueError(
            f"no metric of {list(runs)} matches a panel ({[p for _, p in panels]}); metrics found: {series_keys}"
        )
    return drawn


def _draw_panel(ax, *, keys: list[str], records: Sequence[list[dict]], labels: Sequence[str], colors) -> None:
    """Overlay every run's curve of each of ``keys`` on ``ax``."""
    num_runs = len(records)
    for run_index, (recs, label) in enumerate(zip(records, labels)):
        width = 1.0 + 2.0 * (num_runs - 1 - run_index) / max(1, num_runs - 1) if num_runs > 1 else 1.5
        for key_index, key in enumerate(keys):
            points = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
            if not points:
                continue
            steps, values = zip(*points)
            ax.plot(
                steps,
                values,
                color=colors[run_index % len(colors)],
                linestyle=LINE_STYLES[key_index % len(LINE_STYLES)],
                linewidth=width,
                marker="o" if len(points) == 1 else None,
                label=f"{label}: {key}" if num_runs > 1 else key,
            )


def plot_runs(
    runs: Sequence[str],
    *,
    out: str,
    labels: Sequence[str] | None = None,
    panels: Sequence[tuple[str, str]] = DEFAULT_PANELS,
    title: str | None = None,
) -> str:
    """Draw every run's metrics matching each panel's regex, overlaid; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("give at least one run directory or metrics.jsonl file")
    if labels is not None and len(labels) != len(runs):
        raise ValueError(f"got {len(labels)} labels for {len(runs)} runs; give one label per run")
    records = [read_metrics(run) for run in runs]
    labels = list(labels) if labels is not None else run_labels(runs)
    drawn = _panel_keys(runs, _numeric_keys(records), panels)
    fig, axes = plt.subplots(len(drawn), 1, figsize=(8, 3.2 * len(drawn)), squeeze=False, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, keys) in zip(axes[:, 0], drawn):
        _draw_panel(ax, keys=keys, records=records, labels=labels, colors=colors)
        ax.set_title(name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(out, png.getvalue())  # a link at ``out`` is replaced, never written through
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """CLI entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description="Plot metrics.jsonl curves of one or more runs to a PNG.")
    parser.add_argument("runs", nargs="+", help=f"run directories (holding {METRICS_FILE}) or jsonl files")
    parser.add_argument("--out", default=None, help="output PNG (default: <first run>/curves.png)")
    parser.add_argument("--labels", default=None, help="comma-separated label per run")
    parser.add_argument("--keys", action="append", default=[], help="extra panel: a regex over metric names")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    first_dir = args.runs[0] if os.path.isdir(args.runs[0]) else os.path.dirname(args.runs[0])
    out = args.out or os.path.join(first_dir, "curves.png")
    panels = (*DEFAULT_PANELS, *((pattern, pattern) for pattern in args.keys))
    labels = args.labels.split(",") if args.labels else None
    print(plot_runs(args.runs, out=out, labels=labels, panels=panels, title=args.title))


if __name__ == "__main__":
    main()
