"""The driver's rollout batch, built the same way by the sync and the async trainer.

``prompt_batch`` is what the rollout workers read of a loader item; ``rollout_batch`` is the training
batch: one row per response, prompt-major, each carrying its prompt's ``uid`` and non-tensor fields.
"""

from __future__ import annotations

import numpy as np
import torch

from verl_balance.batch_keys import (
    ATTENTION_MASK_KEY,
    INDEX_KEY,
    PROMPT_IDS_KEY,
    PROMPT_INDEX_KEY,
    PROMPT_LENGTHS_KEY,
    SAMPLE_INDEX_KEY,
    UID_KEY,
)
from verl_balance.protocol import Batch
from verl_balance.rollout import RolloutOutput, build_rollout_batch
from verl_balance.rollout.agent_loop import AGENT_NAME_KEY

PROMPT_COLUMNS = ("data_source", "ground_truth", "extra_info")
"""Per-prompt columns the reward reads, carried from the loader item onto every response row."""


def prompt_batch(prompts: tuple[dict, dict], *, multi_turn: bool = False) -> Batch:
    """One row per prompt: token ids, length and dataset index (its samples' seed); with ``multi_turn``
    also the chat, ``extra_info`` and ``agent_name``."""
    tensors, non_tensors = prompts
    columns = {PROMPT_IDS_KEY: non_tensors[PROMPT_IDS_KEY]}
    if multi_turn:
        columns.update({key: non_tensors[key] for key in ("raw_prompt", "extra_info", AGENT_NAME_KEY)})
    return Batch.from_dict(
        tensors={PROMPT_LENGTHS_KEY: tensors[ATTENTION_MASK_KEY].sum(1)},
        non_tensors={**columns, SAMPLE_INDEX_KEY: np.asarray(non_tensors[INDEX_KEY], dtype=np.int64)},
    )


def rollout_batch(prompts: tuple[dict, dict], output: RolloutOutput, *, pad_token_id: int) -> Batch:
    """The training batch of ``output`` (prompt-major rows, ``output.prompt_index`` into ``prompts``)."""
    _, non_tensors = prompts
    columns = {UID_KEY: non_tensors[INDEX_KEY], **{key: non_tensors[key] for key in PROMPT_COLUMNS}}
    return build_rollout_batch(
        prompts=list(non_tensors[PROMPT_IDS_KEY]), output=output, pad_token_id=pad_token_id, prompt_columns=columns
    )


def merge_rollout_outputs(
    outputs: list[RolloutOutput | None], *, prompt_offsets: list[int], pad_token_id: int
) -> RolloutOutput:
    """One RolloutOutput from per-worker outputs; worker w answered prompts from ``prompt_offsets[w]``."""
    parts = [(o, off) for o, off in zip(outputs, prompt_offsets) if o is not None]
    width = max(o.responses.shape[1] for o, _ in parts)

    def pad(t, value):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    has_log_probs = all(o.log_probs is not None for o, _ in parts)
    multi_turn = all(o.prompts is not None for o, _ in parts)
    return RolloutOutput(
        prompt_index=np.concatenate([o.prompt_index + off for o, off in parts]),
        responses=torch.cat([pad(o.responses, pad_token_id) for o, _ in parts]),
        response_mask=torch.cat([pad(o.response_mask, 0) for o, _ in parts]),
        response_lengths=torch.cat([o.response_lengths for o, _ in parts]),
        finish_reasons=np.concatenate([o.finish_reasons for o, _ in parts]),
        log_probs=torch.cat([pad(o.log_probs, 0.0) for o, _ in parts]) if has_log_probs else None,
        prompts=[p for o, _ in parts for p in o.prompts] if multi_turn else None,
        turn_stats={k: np.concatenate([o.turn_stats[k] for o, _ in parts]) for k in parts[0][0].turn_stats}
        if multi_turn
        else None,
    )


def mini_batch_rows(batch: Batch, *, size: int) -> list[np.ndarray]:
    """Row indices of each mini-batch: ``size`` consecutive prompts, all their responses."""
    prompt_of_row = np.asarray(batch[PROMPT_INDEX_KEY], dtype=np.int64)
    num = -(-int(prompt_of_row.max() + 1) // size)
    return [np.flatnonzero(prompt_of_row // size == k) for k in range(num)]


__all__ = ["PROMPT_COLUMNS", "merge_rollout_outputs", "mini_batch_rows", "prompt_batch", "rollout_batch"]
