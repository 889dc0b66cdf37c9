"""Chat parquet files in verl's SFT schema for the tests (no downloads)."""

from __future__ import annotations


def write_chat_parquet(path, *, rows: int) -> None:
    """``rows`` random two-turn chats (verl's ``messages`` column) from a small vocabulary, seed 0."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and then ran to see the big red dog near our house".split()
    chats = [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choice(words, size=rng.integers(3, 12)))},
                {"role": "assistant", "content": " ".join(rng.choice(words, size=rng.integers(2, 30)))},
            ]
        }
        for _ in range(rows)
    ]
    pq.write_table(pa.Table.from_pylist(chats), path)
