"""A tiny gsm8k-shaped data set in verl's format.

``write_gsm8k_parquet(path, count=...)`` writes rows as verl's ``examples/data_preprocess/gsm8k.py``
lays them out: ``data_source="openai/gsm8k"``, ``prompt`` a one-message user chat ending with the
"####" instruction, ``ability="math"``, ``reward_model={"style": "rule", "ground_truth": "<number>"}``
and ``extra_info`` (split, index, question, answer). The questions are generated arithmetic, so
nothing is downloaded.
"""

from __future__ import annotations

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "openai/gsm8k"


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
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(gsm8k_rows(count, split=split, seed=seed)), path)
    return path
