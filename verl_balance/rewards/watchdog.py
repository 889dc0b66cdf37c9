"""``score_batch`` with a per-call time limit and heartbeat lines: a slow or hung reward function
fails naming itself, the sample and the time, instead of stalling the driver silently.

The reward function runs in a daemon thread (so an abandoned call cannot block the interpreter's exit);
the driver logs a heartbeat every ``heartbeat_s`` and raises ``RewardTimeoutError`` after ``timeout_s``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .children import RewardChildren
from .score import RewardError, RewardFn, score_batch

logger = logging.getLogger(__name__)


class RewardTimeoutError(RewardError, TimeoutError):
    """One reward call ran longer than the configured per-call limit."""


def describe_reward_fn(fn: RewardFn) -> str:
    """``module.qualname`` of a reward function (through ``functools.partial``)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class _CallClock:
    """Which sample the reward thread is scoring and since when (read by the waiting thread)."""

    def __init__(self, reward_fn: RewardFn) -> None:
        self.reward_fn = reward_fn
        self.done = 0
        self.index: int | None = None
        self.started = time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, data_source, solution, ground_truth, extra_info):
        with self.lock:
            self.index, self.started = self.done, time.monotonic()
        try:
            return self.reward_fn(data_source, solution, ground_truth, extra_info)
        finally:
            with self.lock:
                self.done += 1
                self.index = None

    def current(self) -> tuple[int | None, float, int]:
        """(sample being scored or None, seconds it has run, samples done)."""
        with self.lock:
            return self.index, time.monotonic() - self.started, self.done


def score_batch_watched(
    *,
    reward_fn: RewardFn,
    data_sources: Sequence[str],
    solutions: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
    timeout_s: float | None,
    heartbeat_s: float | None,
    name: str | None = None,
    timeout_key: str = "custom_reward_function.timeout_s",
    children: RewardChildren | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``score_batch`` of the same arguments; RewardTimeoutError naming ``name`` (default: the
    function's module and name), the sample and its data source when one call exceeds ``timeout_s``.
    ``children`` records the processes the calls leave running (``RewardChildren.reap`` ends them)."""
    with children.watch() if children is not None else contextlib.nullcontext():
        clock = _CallClock(reward_fn)
        finished, result = _score_in_thread(
            clock,
            data_sources=data_sources,
            solutions=solutions,
            ground_truths=ground_truths,
            extra_infos=extra_infos,
        )
        _wait_watched(
            finished,
            clock,
            name=name or describe_reward_fn(reward_fn),
            data_sources=data_sources,
            n_samples=len(solutions),
            timeout_s=timeout_s,
            heartbeat_s=heartbeat_s,
            timeout_key=timeout_key,
        )
    if "error" in result:
        raise result["error"]
    return result["value"]


def _score_in_thread(clock: _CallClock, **batch) -> tuple[threading.Event, dict[str, Any]]:
    """Start ``score_batch(reward_fn=clock, **batch)`` in a daemon thread; the event is set when it
    ends, the dict then holds ``value`` or ``error``."""
    result: dict[str, Any] = {}
    finished = threading.Event()

    def run() -> None:
        try:
            result["value"] = score_batch(reward_fn=clock, **batch)
        except BaseException as err:  # re-raised in the caller's thread
            result["error"] = err
        finally:
            finished.set()

    threading.Thread(target=run, name="reward", daemon=True).start()
    return finished, result


def _wait_watched(
    finished: threading.Event,
    clock: _CallClock,
    *,
    name: str,
    data_sources: Sequence[str],
    n_samples: int,
    timeout_s: float | None,
    heartbeat_s: float | None,
    timeout_key: str,
) -> None:
    """Wait for ``finished``, logging a heartbeat every ``heartbeat_s``; RewardTimeoutError once one
    call has run for ``timeout_s``."""
    start = time.monotonic()
    next_beat = start + heartbeat_s if heartbeat_s else None
    while not finished.wait(timeout=_next_wake(clock, timeout_s, next_beat)):
        index, running_s, done = clock.current()
        if timeout_s is not None and index is not None and running_s >= timeout_s:
            raise RewardTimeoutError(
                f"reward function {name} did not return within {timeout_key}={timeout_s:g} s on sample {index} "
                f"(data_source {data_sources[index]!r}; running {running_s:.1f} s; {done} of {n_samples} "
                f"samples scored); make it faster or raise {timeout_key}"
            )
        if next_beat is not None and time.monotonic() >= next_beat:
            logger.warning(
                "still waiting for reward function %s after %.0f s: sample %s running for %.0f s, %d of %d scored",
                name,
                time.monotonic() - start,
                index,
                running_s,
                done,
                n_samples,
            )
            next_beat = time.monotonic() + heartbeat_s


def _next_wake(clock: _CallClock, timeout_s: float | None, next_beat: float | None) -> float:
    """Seconds until the current call's limit or the next heartbeat, whichever is first (at most 1 s)."""
    waits = [1.0]
    index, running_s, _ = clock.current()
    if timeout_s is not None and index is not None:
        waits.append(timeout_s - running_s)
    if next_beat is not None:
        waits.append(next_beat - time.monotonic())
    return max(0.01, min(waits))
