"""Generations on disk, as verl writes them: ``trainer.rollout_data_dir`` / ``trainer.validation_data_dir``
get ``<step>.jsonl``, one line per response: ``{"input", "output", "gts", "score", "step", **extras}``.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from verl_balance.batch_keys import INPUT_IDS_KEY, PROMPT_LENGTHS_KEY, RESPONSE_LENGTHS_KEY
from verl_balance.utils.atomic_io import atomic_write_text

__all__ = ["decode_generations", "dump_generations"]

logger = logging.getLogger(__name__)


def decode_generations(
    batch, tokenizer, *, skip_special_tokens: bool = True, limit: int | None = None
) -> tuple[list[str], list[str]]:
    """(prompts, responses) of a rollout batch's rows (the first ``limit`` of them), decoded row by row."""
    starts, lengths = batch[PROMPT_LENGTHS_KEY].tolist(), batch[RESPONSE_LENGTHS_KEY].tolist()
    inputs, outputs = [], []
    for i in range(len(starts) if limit is None else min(limit, len(starts))):
        row = batch[INPUT_IDS_KEY][i].tolist()
        inputs.append(tokenizer.decode(row[: starts[i]], skip_special_tokens=skip_special_tokens))
        outputs.append(
            tokenizer.decode(row[starts[i] : starts[i] + lengths[i]], skip_special_tokens=skip_special_tokens)
        )
    return inputs, outputs


def dump_generations(
    directory: str, *, step: int, batch, tokenizer, scores: np.ndarray, extras: dict[str, np.ndarray]
) -> str:
    """Write ``<directory>/<step>.jsonl`` (atomically) in verl's layout; returns its path."""
    inputs, outputs = decode_generations(batch, tokenizer)
    columns = {
        "input": inputs,
        "output": outputs,
        "gts": [_plain(g) for g in batch["ground_truth"]],
        "score": [float(s) for s in scores],
        "step": [int(step)] * len(inputs),
    }
    for key, values in extras.items():
        if len(values) == len(inputs):
            columns[key] = [_plain(v) for v in values]
    lines = [json.dumps({k: v[i] for k, v in columns.items()}, ensure_ascii=False) for i in range(len(inputs))]
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{int(step)}.jsonl")
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    logger.info("generations of step %d: %s", step, path)
    return path


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value if isinstance(value, (str, int, float, bool, type(None), list, dict)) else str(value)
