"""Experiment tracking on the driver: console, a jsonl file (always), TensorBoard, W&B and MLflow.

``<log_dir>/metrics.jsonl`` gets one strict-JSON object per ``log`` call, ``{"step", "time",
**metrics}``, appended and flushed (non-finite values as null, named under ``"nonfinite"``); a
resumed run first cuts it back to its step, so one file holds one run's curve. A backend asked for
but not installed gives a warning naming the package. Metric names: docs/metrics.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import Any

from verl_balance.utils.atomic_io import atomic_write_json, atomic_write_text, make_dir_nofollow, open_nofollow
from verl_balance.utils.disk import disk_full_text, is_disk_full

logger = logging.getLogger(__name__)
BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
DEFAULT_CONSOLE_PATTERNS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens_per_s",
    "imbalance",
    "score/mean",
    "accuracy",
    "response_length/mean",
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


NONFINITE_KEY = "nonfinite"
"""Key of a metrics record naming its non-finite values (written as null; ``read_metrics`` restores them)."""


def strict_json_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with each non-finite float as None, named under ``NONFINITE_KEY``."""
    bad = {k: repr(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
    if not bad:
        return dict(record)
    return {**{k: (None if k in bad else v) for k, v in record.items()}, NONFINITE_KEY: bad}


def _restore_nonfinite(record: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``strict_json_record`` (older files with bare NaN tokens read unchanged)."""
    bad = record.pop(NONFINITE_KEY, None) or {}
    for key, text in bad.items():
        record[key] = float(text)
    return record


def plain_config(config: Any) -> Any:
    """OmegaConf/dataclass/mapping config -> JSON-able containers (interpolations resolved)."""
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
        config_dict = plain_config(config)
        atomic_write_json(
            os.path.join(log_dir, RUN_FILE),
            {"project": project, "experiment": experiment, "config": config_dict},
            indent=2,
        )
        drop_torn_last_line(self.metrics_path)
        self._jsonl = open_nofollow(self.metrics_path, "a")  # a planted link: UnsafePathError
        self._console = "console" in backends
        self._progress = self._open_progress(total_steps) if self._console else None
        self._tensorboard = self._open_tensorboard() if "tensorboard" in backends else None
        self._wandb = self._open_wandb(config_dict) if "wandb" in backends else None
        self._mlflow = self._open_mlflow(config_dict) if "mlflow" in backends else None

    def _open_progress(self, total_steps: int | None) -> Any:
        """A tqdm progress bar on stderr (disabled when stderr is not a terminal)."""
        from tqdm import tqdm

        return tqdm(
            total=total_steps,
            desc=f"{self.project}/{self.experiment}",
            unit="step",
            dynamic_ncols=True,
            disable=not sys.stderr.isatty(),
        )

    def _open_tensorboard(self) -> Any:
        """A SummaryWriter under ``<log_dir>/tensorboard``; None (a warning) without tensorboard."""
        if importlib.util.find_spec("tensorboard") is None:
            logger.warning(
                "logger 'tensorboard' requested but the tensorboard package is not installed "
                "(pip install tensorboard); continuing without it"
            )
            return None
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=make_dir_nofollow(os.path.join(self.log_dir, "tensorboard")))

    def _open_wandb(self, config_dict: Any) -> Any:
        """A W&B run (offline unless WANDB_MODE is set); None (a warning) without wandb."""
        if importlib.util.find_spec("wandb") is None:
            logger.warning(
                "logger 'wandb' requested but the wandb package is not installed (pip install wandb); "
                "continuing without it"
            )
            return None
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        return wandb.init(project=self.project, name=self.experiment, dir=self.log_dir, config=config_dict)

    def _open_mlflow(self, config_dict: Any) -> Any:
        """An MLflow run in a local file store; None (a warning) without mlflow."""
        if importlib.util.find_spec("mlflow") is None:
            logger.warning(
                "logger 'mlflow' requested but the mlflow package is not installed "
                "(pip install 'verl_balance[mlflow]'); continuing without it"
            )
            return None
        import mlflow

        if "MLFLOW_TRACKING_URI" not in os.environ:
            mlflow.set_tracking_uri("file://" + os.path.abspath(os.path.join(self.log_dir, "mlruns")))
        mlflow.set_experiment(self.project)
        run = mlflow.start_run(run_name=self.experiment)
        mlflow.log_dict(config_dict or {}, "config.json")
        return run

    @property
    def metrics_path(self) -> str:
        """Path of the jsonl metrics file."""
        return os.path.join(self.log_dir, METRICS_FILE)

    def log(self, metrics: Mapping[str, Any], *, step: int) -> None:
        """Record one step's metrics on every backend."""
        values = {key: to_scalar(key, value) for key, value in metrics.items()}
        record = {"step": int(step), "time": time.time(), **values}
        try:
            self._jsonl.write(json.dumps(strict_json_record(record), allow_nan=False) + "\n")
            self._jsonl.flush()
        except OSError as err:
            with contextlib.suppress(OSError):  # its buffer cannot be flushed either: drop it
                self._jsonl.close()
            if not is_disk_full(err):
                raise
            raise TrackingError(disk_full_text(f"append step {step} to {METRICS_FILE}", self.log_dir)) from err
        numeric = {k: v for k, v in values.items() if not isinstance(v, str)}
        if self._tensorboard is not None:
            for key, value in numeric.items():
                self._tensorboard.add_scalar(key, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._mlflow is not None:
            import mlflow

            mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in numeric.items()}, step=step)
        if self._console:
            self._print(numeric, step=step)

    def truncate_after(self, step: int) -> None:
        """Drop the records logged past ``step`` (a run that went back to a checkpoint)."""
        self._jsonl.close()
        rewrite_metrics_up_to(self.metrics_path, step)
        self._jsonl = open_nofollow(self.metrics_path, "a")  # a planted link: UnsafePathError
        if self._progress is not None:
            self._progress.n = min(self._progress.n, step)

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
        if self._mlflow is not None:
            import mlflow

            mlflow.end_run()
            self._mlflow = None
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


def drop_torn_last_line(path: str) -> bool:
    """Cut a last line without its newline (a torn write); True if one was dropped. Never follows a link."""
    if not os.path.lexists(path):
        return False
    with open_nofollow(path, "rb", encoding=None) as f:
        data = f.read()
    if not data or data.endswith(b"\n"):
        return False
    keep = data[: data.rfind(b"\n") + 1]
    logger.warning(
        "%s: dropping a torn last line (%d bytes, a write interrupted by a crash): %r",
        path,
        len(data) - len(keep),
        data[len(keep) :][:80],
    )
    atomic_write_text(path, keep.decode("utf-8", errors="replace"))
    return True


def _parse_lines(path: str, *, nofollow: bool = False) -> list[tuple[str, dict]]:
    """(line, record) of every non-empty line; a torn last line is dropped with a warning."""
    if nofollow:
        with open_nofollow(path, "r", errors="replace") as f:
            lines = f.read().split("\n")
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
    out = []
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise json.JSONDecodeError("not a record with a step", line, 0)
        except json.JSONDecodeError as err:
            if index == last:
                logger.warning("%s: line %d is torn (%s), dropped: %r", path, index + 1, err.msg, line[:80])
                continue
            raise TrackingError(f"{path}: line {index + 1} is not valid JSON ({err.msg})") from err
        out.append((line, _restore_nonfinite(record)))
    return out


def rewrite_metrics_up_to(path: str, step: int) -> None:
    """Keep the records of steps <= ``step`` (and drop a torn last line), atomically."""
    kept = [line for line, record in _parse_lines(path, nofollow=True) if int(record["step"]) <= step]
    atomic_write_text(path, "".join(line + "\n" for line in kept))


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl (or a run directory holding one), one per step, sorted by step.

    Records of the same step are merged, later values winning. A torn last line is dropped with a
    warning; a bad line elsewhere is a ``TrackingError`` naming it."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    by_step: dict[int, dict[str, Any]] = {}
    for _, record in _parse_lines(path):
        by_step.setdefault(int(record["step"]), {}).update(record)
    return [by_step[step] for step in sorted(by_step)]
