"""A tiny gsm8k-shaped data set in verl's format, and a gsm8k rule reward in verl's signature.

``write_gsm8k_parquet(path, count=...)`` writes rows as verl's ``examples/data_preprocess/gsm8k.py``
lays them out: ``data_source="openai/gsm8k"``, ``prompt`` a one-message user chat ending with the
"####" instruction, ``ability="math"``, ``reward_model={"style": "rule", "ground_truth": "<number>"}``
and ``extra_info`` (split, index, question, answer). The questions are generated arithmetic, so
nothing is downloaded.

``compute_score`` is verl's gsm8k rule restated (strict format): 1.0 when the last ``#### <number>``
of the response equals the ground truth (commas and a ``$`` dropped), else 0.0. Our package has no
built-in rule for ``openai/gsm8k``: a run passes this file as ``custom_reward_function.path``.
"""

from __future__ import annotations

import re

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "openai/gsm8k"
_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_rows(count: int, *, split: str = "train", seed: int = 0) -> list[dict]:
    """``count`` rows in verl's gsm8k layout (arithmetic word problems, deterministic in ``seed``)."""
    import random

    rng = random.Random(seed)
    rows = []
    for index in range(count):
        a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(1, 9)
        question = f"Tom has {a} apples, buys {b} and gives away {c}. How many are left?"
        answer = a + b - c
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(answer)},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "question": question,
                    "answer": f"{a}+{b}-{c} = {answer}\n#### {answer}",
                },
            }
        )
    return rows


def write_gsm8k_parquet(path: str, *, count: int, split: str = "train", seed: int = 0) -> str:
    """Write ``gsm8k_rows(count)`` to the parquet file ``path``; returns ``path``."""
    import pandas as pd

    pd.DataFrame(gsm8k_rows(count, split=split, seed=seed)).to_parquet(path)
    return path


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """1.0 when the response's last ``#### <number>`` is ``ground_truth``, else 0.0."""
    matches = _FINAL.findall(solution_str[-300:])  # verl reads the tail only: a long response cannot stall it
    if not matches:
        return 0.0
    final = matches[-1].replace(",", "").replace("$", "")
    return 1.0 if final == str(ground_truth) else 0.0
