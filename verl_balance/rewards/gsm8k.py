"""The rule for ``data_source="openai/gsm8k"`` (verl's ``default_compute_score`` strict method).

The answer is the last ``#### <number>`` in the response's final 300 characters (commas and ``$``
dropped). Score: ``score`` (1.0) on a match, ``format_score`` (0.0) on a mismatch, 0.0 without a
``####`` answer; returns ``{"score", "acc", "format_ok"}``.
"""

from __future__ import annotations

import re
from typing import Any

GSM8K_DATA_SOURCE = "openai/gsm8k"
TAIL_CHARS = 300
_FINAL_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_gsm8k_answer(solution_str: str) -> str | None:
    """The last ``#### <number>`` of the response's tail, normalised; None when there is none."""
    matches = _FINAL_ANSWER.findall(solution_str[-TAIL_CHARS:])
    if not matches:
        return None
    return matches[-1].replace(",", "").replace("$", "")


def score_gsm8k(
    *, solution_str: str, ground_truth: Any, format_score: float = 0.0, score: float = 1.0
) -> dict[str, float]:
    """verl's strict gsm8k rule on one response."""
    answer = extract_gsm8k_answer(solution_str)
    correct = answer is not None and answer == str(ground_truth).strip()
    value = float(score) if correct else (float(format_score) if answer is not None else 0.0)
    return {"score": value, "acc": float(correct), "format_ok": float(answer is not None)}
