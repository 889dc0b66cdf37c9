"""Wire tensors for the trainer from prompts and a RolloutOutput.

Invariants (docs/design.md, "Wire format"): one row per response, in RolloutOutput order;
``input_ids[k] = prompt + response`` right-padded to the longest; ``attention_mask`` is 1 on the real
tokens; ``loss_mask[k, t] = 1`` exactly where the rollout's ``response_mask`` marks the token (tool
answers are context); ``position_ids`` restart at 0 per sequence; ``rollout_log_probs`` is aligned
like ``loss_mask`` (0 elsewhere).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from verl_balance.batch_keys import (
    ATTENTION_MASK_KEY,
    FINISH_REASON_KEY,
    INPUT_IDS_KEY,
    LOSS_MASK_KEY,
    POSITION_IDS_KEY,
    PROMPT_INDEX_KEY,
    PROMPT_LENGTHS_KEY,
    RESPONSE_LENGTHS_KEY,
    ROLLOUT_LOG_PROBS_KEY,
)
from verl_balance.protocol import Batch
from verl_balance.rollout.base import RolloutInputError, RolloutOutput


def build_rollout_tensors(
    *, prompts: Sequence[Sequence[int]], output: RolloutOutput, pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """(N, L) ``input_ids``, ``attention_mask``, ``loss_mask``, ``position_ids``,
    ``rollout_log_probs`` (if the rollout returned them) and (N,) ``prompt_lengths``,
    ``response_lengths``, all on CPU. ``output.prompt_index`` maps rows to ``prompts``."""
    if len(output) and int(output.prompt_index.max()) >= len(prompts):
        raise RolloutInputError(
            f"output answers prompt {int(output.prompt_index.max())} but only {len(prompts)} prompts were given"
        )
    if output.prompts is not None:  # a multi-turn rollout formed its own prompts
        prompt_rows = [list(p) for p in output.prompts]
    else:
        prompt_rows = [list(prompts[i]) for i in output.prompt_index.tolist()]
    responses = output.response_token_lists()
    prompt_lengths = torch.tensor([len(p) for p in prompt_rows], dtype=torch.int64)
    response_lengths = output.response_lengths.cpu().to(torch.int64)
    total = prompt_lengths + response_lengths
    width = int(total.max()) if len(total) else 0

    input_ids = torch.full((len(prompt_rows), width), pad_token_id, dtype=torch.int64)
    loss_mask = torch.zeros((len(prompt_rows), width), dtype=torch.int64)
    response_mask = output.response_mask.detach().cpu().to(torch.int64)
    for row, (prompt, response) in enumerate(zip(prompt_rows, responses)):
        input_ids[row, : len(prompt) + len(response)] = torch.tensor(prompt + response, dtype=torch.int64)
        loss_mask[row, len(prompt) : len(prompt) + len(response)] = response_mask[row, : len(response)]
    slot = torch.arange(width)[None, :]
    attention_mask = (slot < total[:, None]).long()
    tensors = {
        INPUT_IDS_KEY: input_ids,
        ATTENTION_MASK_KEY: attention_mask,
        LOSS_MASK_KEY: loss_mask,
        POSITION_IDS_KEY: slot.expand(len(prompt_rows), width) * attention_mask,
        PROMPT_LENGTHS_KEY: prompt_lengths,
        RESPONSE_LENGTHS_KEY: response_lengths,
    }
    if output.log_probs is not None:
        rollout_log_probs = torch.zeros(len(prompt_rows), width, dtype=torch.float32)
        source = output.log_probs.detach().cpu().float()
        response_slot = (slot - prompt_lengths[:, None]).clamp(min=0, max=max(source.shape[1] - 1, 0))
        if source.shape[1]:
            rollout_log_probs = torch.where(loss_mask.bool(), source.gather(1, response_slot), rollout_log_probs)
        tensors[ROLLOUT_LOG_PROBS_KEY] = rollout_log_probs
    return tensors


def group_uids(output: RolloutOutput, *, prompt_uids: Sequence | None = None) -> np.ndarray:
    """Group label of each row for advantage estimation: ``prompt_uids[prompt_index]`` (object
    array) or, without uids, the prompt index itself."""
    if prompt_uids is None:
        return output.prompt_index.copy()
    return np.asarray(prompt_uids, dtype=object)[output.prompt_index]


def build_rollout_batch(
    *,
    prompts: Sequence[Sequence[int]],
    output: RolloutOutput,
    pad_token_id: int = 0,
    prompt_columns: Mapping[str, Sequence[Any]] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> Batch:
    """A Batch with one row per response: ``build_rollout_tensors`` plus ``prompt_index``, ``finish_reason``,
    ``turn_stats`` (multi-turn) and every column of ``prompt_columns`` repeated per response."""
    tensors = build_rollout_tensors(prompts=prompts, output=output, pad_token_id=pad_token_id)
    non_tensors = {PROMPT_INDEX_KEY: output.prompt_index.copy(), FINISH_REASON_KEY: output.finish_reasons.copy()}
    non_tensors.update({name: np.asarray(values).copy() for name, values in (output.turn_stats or {}).items()})
    for name, values in (prompt_columns or {}).items():
        if len(values) != len(prompts):
            raise RolloutInputError(f"prompt column {name!r} has {len(values)} entries for {len(prompts)} prompts")
        column = np.empty(len(values), dtype=object)
        column[:] = list(values)
        non_tensors[name] = column[output.prompt_index]
    return Batch.from_dict(tensors=tensors, non_tensors=non_tensors, meta=dict(meta or {}))
