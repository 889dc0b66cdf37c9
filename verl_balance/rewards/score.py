"""Reward dispatch by data_source (verl's ``default_compute_score`` convention) and batch scoring.

A reward function has verl's signature
``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float | dict``;
a dict must carry the reward under ``"score"``; its other numeric entries are reported as
per-sample metrics. ``score_batch`` never lets a NaN or non-number through: it raises, naming
the sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from numbers import Real
from typing import Any

import numpy as np

from .gsm8k import GSM8K_DATA_SOURCE, score_gsm8k
from .synthetic import SYNTHETIC_DATA_SOURCES, score_task

RewardFn = Callable[..., float | dict[str, Any]]


class RewardError(ValueError):
    """A reward function, data source or reward value that cannot be used."""


_SCORERS: dict[str, Callable[..., float | dict[str, Any]]] = {
    **{source: partial(score_task, task=source.split("/", 1)[1]) for source in SYNTHETIC_DATA_SOURCES},
    GSM8K_DATA_SOURCE: score_gsm8k,
}


def register_scorer(
    data_source: str, scorer: Callable[..., float | dict[str, Any]], *, overwrite: bool = False
) -> None:
    """Route ``data_source`` to ``scorer(solution_str=..., ground_truth=..., **kwargs)``."""
    if data_source in _SCORERS and not overwrite:
        raise RewardError(f"data_source {data_source!r} already has a scorer; pass overwrite=True to replace it")
    _SCORERS[data_source] = scorer


def known_data_sources() -> list[str]:
    """Data sources ``compute_score`` can score."""
    return sorted(_SCORERS)


def check_reward_rules(data_source_rows: Mapping[str, tuple[str, int]]) -> None:
    """RewardError naming the first data_source (and the file and row of its first prompt) that the
    built-in ``compute_score`` has no rule for: read from the data before any response is generated."""
    unknown = sorted(set(data_source_rows) - set(_SCORERS))
    if unknown:
        path, row = data_source_rows[unknown[0]]
        more = f" (and {len(unknown) - 1} more: {unknown[1:4]})" if len(unknown) > 1 else ""
        raise RewardError(
            f"no reward rule for data_source {unknown[0]!r} ({path}, row {row}){more}; known: "
            f"{known_data_sources()}. Set custom_reward_function.path=<file.py> (and .name) to score it"
        )


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None, **kwargs: Any
) -> float | dict[str, Any]:
    """Score one response with the rule for its data_source (kwargs, e.g. format_score, go to it)."""
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise RewardError(
            f"no reward rule for data_source {data_source!r}; known: {known_data_sources()}. Provide "
            "custom_reward_function.path/name or register_scorer()"
        )
    return scorer(solution_str=solution_str, ground_truth=ground_truth, **kwargs)


def score_batch(
    *,
    reward_fn: RewardFn,
    data_sources: Sequence[str],
    solutions: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Mapping[str, Any] | None] | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Score every response: (float32 scores [B], extra per-sample metrics {name: float32 [B]}); an extra
    missing from some samples is NaN there."""
    count = len(solutions)
    if not len(data_sources) == len(ground_truths) == count or (extra_infos is not None and len(extra_infos) != count):
        raise RewardError("data_sources, solutions, ground_truths and extra_infos must have the same length")
    scores = np.zeros(count, dtype=np.float32)
    extras: dict[str, np.ndarray] = {}
    for i in range(count):
        extra_info = None if extra_infos is None else extra_infos[i]
        try:
            result = reward_fn(data_sources[i], solutions[i], ground_truths[i], extra_info)
        except SystemExit as err:  # sys.exit() in a reward must not end the run as a success (rc 0)
            raise RewardError(
                f"the reward function raised SystemExit({err.code!r}) (sys.exit / exit) on sample {i} (data_source "
                f"{data_sources[i]!r}): a reward function must return a score, it cannot end the run. Return a "
                "score (e.g. 0.0) or raise an exception instead"
            ) from err
        except Exception as err:  # keep its type; the note names the row the traceback alone does not
            err.add_note(
                f"raised by the reward function on sample {i} (data_source {data_sources[i]!r}, ground truth "
                f"{ground_truths[i]!r}, response {str(solutions[i])[:80]!r})"
            )
            raise
        if isinstance(result, Mapping):
            if "score" not in result:
                raise RewardError(f"sample {i} ({data_sources[i]}): reward dict has no 'score' key: {sorted(result)}")
            for key, value in result.items():
                if key != "score" and isinstance(value, (Real, bool)):
                    extras.setdefault(key, np.full(count, np.nan, dtype=np.float32))[i] = float(value)
            result = result["score"]
        if not isinstance(result, (Real, bool)) or not math.isfinite(float(result)):
            raise RewardError(f"sample {i} ({data_sources[i]}): reward must be a finite number, got {result!r}")
        scores[i] = float(result)
    return scores, extras
