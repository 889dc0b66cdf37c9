"""Rule-based scorers for the synthetic tasks of ``verl_balance.data.synthetic``.

The answer is the first non-empty line of the response, stripped. Score: 1.0 on an exact match,
``format_score`` (default 0.0) for a well-formed wrong answer, 0.0 for a malformed one; scorers
return ``{"score", "acc", "format_ok"}`` (floats).
"""

from __future__ import annotations

import re
from typing import Any

from ..data.synthetic import DATA_SOURCE_PREFIX, TASKS

ANSWER_PATTERNS = {
    "add": re.compile(r"-?\d+"),
    "sort": re.compile(r"\d+"),
    "reverse": re.compile(r"[a-z]+"),
    "copy": re.compile(r"[a-z]+"),
}


def extract_answer(solution_str: str) -> str:
    """First non-empty line of the response, stripped ('' when there is none)."""
    for line in solution_str.splitlines():
        if line.strip():
            return line.strip()
    return ""


def score_task(*, task: str, solution_str: str, ground_truth: Any, format_score: float = 0.0) -> dict[str, float]:
    """Exact-match score of one response to a synthetic task."""
    answer = extract_answer(solution_str)
    format_ok = ANSWER_PATTERNS[task].fullmatch(answer) is not None
    correct = format_ok and answer == str(ground_truth).strip()
    score = 1.0 if correct else (float(format_score) if format_ok else 0.0)
    return {"score": score, "acc": float(correct), "format_ok": float(format_ok)}


SYNTHETIC_DATA_SOURCES = tuple(DATA_SOURCE_PREFIX + task for task in TASKS)
