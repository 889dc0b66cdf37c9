"""The console's progress display: steps done/total, s/step, tokens/s, ETA and the key metrics.

On a terminal a tqdm bar (never in the run log), plus one plain line per step in the run log;
otherwise the plain line every step, or at most every ``interval_s``. The keys shown are
``trainer.console_metrics`` (null: ``DEFAULT_SFT_KEYS`` / ``DEFAULT_RL_KEYS``).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TextIO

from verl_balance.utils import run_log

logger = logging.getLogger(__name__)

DEFAULT_SFT_KEYS = ("train/loss", "val/loss", "train/grad_norm", "train/lr")
"""Console keys of the SFT recipe when ``trainer.console_metrics`` is null."""
DEFAULT_RL_KEYS = (
    "critic/score/mean",
    "val/acc",
    "val/reward_mean",
    "actor/pg_loss",
    "critic/vf_loss",
    "actor/kl_loss",
    "response_length/mean",
)
"""Console keys of the GRPO/PPO recipe when ``trainer.console_metrics`` is null."""
TOKENS_PER_S_KEY = "perf/tokens_per_s"
PHASE_TIMINGS = (
    ("rollout", "timing_s/gen"),
    ("reward", "timing_s/reward"),
    ("log-prob", "timing_s/old_log_prob"),
    ("ref", "timing_s/ref"),
    ("values", "timing_s/values"),
    ("critic update", "timing_s/update_critic"),
    ("update", "timing_s/update_actor"),
)
"""(phase, metric) of a GRPO/PPO step's phases: the plain line shows the seconds of those present."""


def format_value(value: float | int) -> str:
    """A metric as a short number (4 significant digits; scientific outside [1e-3, 1e5))."""
    if isinstance(value, int) or not math.isfinite(value) or value == 0.0:
        return str(value)
    return f"{value:.4g}" if 1e-3 <= abs(value) < 1e5 else f"{value:.3e}"


def format_rate(tokens_per_s: float) -> str:
    """Tokens per second as ``812 tok/s`` / ``2.3k tok/s`` / ``1.2M tok/s``."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{suffix} tok/s"
    return f"{tokens_per_s:.0f} tok/s"


def format_eta(seconds: float) -> str:
    """Seconds as ``H:MM:SS``."""
    return str(datetime.timedelta(seconds=int(round(max(0.0, seconds)))))


class ProgressDisplay:
    """The step progress of one run; s/step and the ETA count this process's steps only (from ``start_step``)."""

    def __init__(
        self,
        *,
        total_steps: int,
        start_step: int = 0,
        keys: Sequence[str] = DEFAULT_SFT_KEYS,
        interval_s: float = 0.0,
        stream: TextIO | None = None,
        is_terminal: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total_steps, self.keys, self.interval_s = total_steps, tuple(keys), interval_s
        self._stream = stream if stream is not None else run_log.console_stream(sys.stdout)
        self._is_terminal = self._stream.isatty() if is_terminal is None else is_terminal
        self._clock = clock
        self._start_step, self._start_time = start_step, clock()
        self._last_printed = -math.inf
        self._step = start_step
        self._bar = None
        if self._is_terminal:
            from tqdm import tqdm

            width = _terminal_columns(self._stream)  # 0 under `script` or a bare pty: tqdm would print nothing
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                file=self._stream,
                dynamic_ncols=width > 0,
                ncols=None if width > 0 else 120,
                unit="step",
                desc="train",
                bar_format="{desc} {n_fmt}/{total_fmt} |{bar}| {elapsed}<{remaining}, {rate_fmt}{postfix}",
            )
            run_log.show_bar(self._bar)  # lines written meanwhile go above the bar, never through it

    def seconds_per_step(self) -> float | None:
        """Mean wall seconds per step of this process (None before its first step)."""
        done = self._step - self._start_step
        return (self._clock() - self._start_time) / done if done > 0 else None

    def line(self, step: int, metrics: Mapping[str, float]) -> str:
        """The plain progress line of ``step``: step/total, s/step, tok/s, ETA, then the console keys."""
        parts = [f"step {step}/{self.total_steps}"]
        per_step = self.seconds_per_step()
        if per_step is not None:
            parts.append(f"{per_step:.3g} s/step")
        if isinstance(metrics.get(TOKENS_PER_S_KEY), (int, float)):
            parts.append(format_rate(float(metrics[TOKENS_PER_S_KEY])))
        if per_step is not None:
            parts.append(f"ETA {format_eta(per_step * (self.total_steps - step))}")
        phases = [f"{name} {metrics[key]:.2g} s" for name, key in PHASE_TIMINGS if _is_number(metrics.get(key))]
        if phases:
            parts.append(", ".join(phases))
        parts += [f"{key} {format_value(metrics[key])}" for key in self.keys if _is_number(metrics.get(key))]
        return " | ".join(parts)

    def phase(self, name: str) -> None:
        """The current phase of the step (shown on the terminal bar only)."""
        if self._bar is not None:
            self._bar.set_description_str(f"step {self._step + 1}: {name}", refresh=True)

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Step ``step`` is done with ``metrics``: move the bar / print the plain line."""
        self._step = step
        line = self.line(step, metrics)
        if self._bar is not None:
            self._bar.set_description_str("train", refresh=False)
            postfix = {k: format_value(metrics[k]) for k in self.keys if _is_number(metrics.get(k))}
            rate = metrics.get(TOKENS_PER_S_KEY)
            prefix = f"{format_rate(float(rate))}, " if _is_number(rate) else ""
            self._bar.set_postfix_str(prefix + ", ".join(f"{k}={v}" for k, v in postfix.items()), refresh=False)
            self._bar.update(max(0, step - self._bar.n))
            run_log.write_log_only(line + "\n")
            return
        now = self._clock()
        if now - self._last_printed >= self.interval_s or step >= self.total_steps:
            self._last_printed = now
            print(line, file=sys.stdout, flush=True)
        else:
            run_log.write_log_only(line + "\n")

    def close(self) -> None:
        """Close the bar (idempotent)."""
        if self._bar is not None:
            run_log.show_bar(None)
            self._bar.close()
            self._bar = None


def _terminal_columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TimedPhase:
    """Logs one line with the phase's duration when it ends; a failed phase logs nothing."""

    def __init__(self, name: str, detail: str = "") -> None:
        self.name, self.detail = name, detail

    def __enter__(self) -> TimedPhase:
        self._start = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            detail = f" ({self.detail})" if self.detail else ""
            logger.info("%s%s: %.1f s", self.name, detail, time.perf_counter() - self._start)


__all__ = [
    "DEFAULT_RL_KEYS",
    "DEFAULT_SFT_KEYS",
    "ProgressDisplay",
    "TimedPhase",
    "format_eta",
    "format_rate",
    "format_value",
]
