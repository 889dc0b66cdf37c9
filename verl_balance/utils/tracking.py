"""Experiment tracking on the driver: console, a jsonl file (always), TensorBoard and W&B.

``<log_dir>/metrics.jsonl`` gets one JSON object per ``log`` call: ``{"step", "time", **metrics}``,
appended and flushed, so a resumed run continues the same file (``read_metrics`` merges the
records of one step, later values winning, so a step re-logged after a resume reads as the new
values). ``<log_dir>/run.json``
holds the project, experiment and config. TensorBoard and W&B are optional: asked for but not
installed gives a warning naming the package, never a crash; W&B runs offline unless WANDB_MODE
is set.

Metric names the plots and recipes look for (the trainers should use these):
``train/loss``, ``val/loss``, ``train/grad_norm``, ``train/lr``, ``perf/tokens_per_s``,
``train/valid_tokens``, ``balance/imbalance_predicted``, ``balance/imbalance_predicted_naive``,
``balance/imbalance_measured``, ``balance/num_micro_batches``, ``reward/mean``, ``reward/std``,
``reward/accuracy``, ``val/accuracy``, ``response_length/mean``, ``timing_s/<phase>``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import Any

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
DEFAULT_CONSOLE_PATTERNS = (
    "loss", "grad_norm", "lr", "tokens_per_s", "imbalance", "reward/mean", "accuracy", "response_length/mean",
)
METRICS_FILE = "metrics.jsonl"
RUN_FILE = "run.json"


class TrackingError(ValueError):
    """An unknown backend or a metric value that cannot be logged."""


def to_scalar(key: str, value: Any) -> float | int | str:
    """A metric value as a plain Python number (or string); tensors and numpy scalars included."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, Real):
        return float(value)
    if isinstance(value, str):
        return value
    raise TrackingError(f"metric {key!r} must be a scalar number or string, got {type(value).__name__}")


def _plain_config(config: Any) -> Any:
    """OmegaConf/dataclass/mapping config -> JSON-able containers."""
    if config is None:
        return None
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(config):
            return OmegaConf.to_container(config, resolve=True)
    except ImportError:
        pass
    if hasattr(config, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(config)
    return config


class Tracking:
    """Fan metrics out to the chosen backends; ``log(metrics, step=...)`` on the driver only."""

    def __init__(
        self,
        project: str,
        experiment: str,
        *,
        log_dir: str,
        backends: Iterable[str] = ("console", "jsonl"),
        config: Any = None,
        total_steps: int | None = None,
        console_patterns: Iterable[str] = DEFAULT_CONSOLE_PATTERNS,
    ):
        backends = list(backends)
        unknown = [b for b in backends if b not in BACKENDS]
        if unknown:
            raise TrackingError(f"unknown logger backend(s) {unknown}; valid: {list(BACKENDS)}")
        self.project, self.experiment, self.log_dir = project, experiment, log_dir
        self.console_patterns = tuple(console_patterns)
        os.makedirs(log_dir, exist_ok=True)
        plain_config = _plain_config(config)
        with open(os.path.join(log_dir, RUN_FILE), "w", encoding="utf-8") as f:
            json.dump({"project": project, "experiment": experiment, "config": plain_config}, f, indent=2, default=str)
        self._jsonl = open(os.path.join(log_dir, METRICS_FILE), "a", encoding="utf-8")
        self._progress = None
        self._console = "console" in backends
        if self._console:
            from tqdm import tqdm

            self._progress = tqdm(
                total=total_steps, desc=f"{project}/{experiment}", unit="step", dynamic_ncols=True,
                disable=not sys.stderr.isatty(),
            )
        self._tensorboard = None
        if "tensorboard" in backends:
            if importlib.util.find_spec("tensorboard") is None:
                warnings.warn(
                    "logger 'tensorboard' requested but the tensorboard package is not installed "
                    "(pip install tensorboard); continuing without it", stacklevel=2,
                )
            else:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(log_dir=os.path.join(log_dir, "tensorboard"))
        self._wandb = None
        if "wandb" in backends:
            if importlib.util.find_spec("wandb") is None:
                warnings.warn(
                    "logger 'wandb' requested but the wandb package is not installed (pip install wandb); "
                    "continuing without it", stacklevel=2,
                )
            else:
                import wandb

                os.environ.setdefault("WANDB_MODE", "offline")
                self._wandb = wandb.init(
                    project=project, name=experiment, dir=log_dir, config=plain_config
                )

    @property
    def metrics_path(self) -> str:
        """Path of the jsonl metrics file."""
        return os.path.join(self.log_dir, METRICS_FILE)

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        """Record one step's metrics on every backend."""
        values = {key: to_scalar(key, value) for key, value in metrics.items()}
        record = {"step": int(step), "time": time.time(), **values}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        numeric = {k: v for k, v in values.items() if not isinstance(v, str)}
        if self._tensorboard is not None:
            for key, value in numeric.items():
                self._tensorboard.add_scalar(key, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._console:
            self._print(numeric, step=step)

    def _print(self, numeric: Mapping[str, float | int], *, step: int) -> None:
        from tqdm import tqdm

        shown = {k: v for k, v in numeric.items() if any(p in k for p in self.console_patterns)}
        line = " | ".join(f"{k} {_format(v)}" for k, v in shown.items())
        if self._progress is not None and not self._progress.disable:
            self._progress.update(max(0, step - self._progress.n))
            self._progress.set_postfix({k: _format(v) for k, v in list(shown.items())[:3]}, refresh=False)
        tqdm.write(f"step {step} | {line}" if line else f"step {step}", file=sys.stdout)

    def close(self) -> None:
        """Flush and close every backend (idempotent)."""
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if not self._jsonl.closed:
            self._jsonl.close()

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _format(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    if not math.isfinite(value) or value == 0.0:
        return str(value)
    return f"{value:.4g}" if 1e-3 <= abs(value) < 1e5 else f"{value:.3e}"


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl (or a run directory holding one), one per step, sorted by step.

    Records of the same step are merged, later values winning: a step logged in two calls
    (train, then eval) reads as one record, and a step re-logged after a resume reads as the
    resumed run's values."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    by_step: dict[int, dict[str, Any]] = {}
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise TrackingError(f"{path}: line {line_number} is not valid JSON ({err.msg})") from err
            by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[step] for step in sorted(by_step)]
