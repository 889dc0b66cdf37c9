"""DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): drop the prompt groups whose metric is
the same for every response, keep generating batches until ``data.train_batch_size`` prompts remain.

Invariants (verl's DAPO trainer):
- A group is kept when the population std of its ``metric`` is > 0 or it has one response.
  ``reward`` / ``score`` / ``seq_reward`` / ``seq_final_reward`` = the score before any KL penalty;
  any other name = that field of the reward's extras (missing: an error naming the key).
- The step trains on the first ``train_batch_size`` kept groups (prompt-major, renumbered 0..P-1);
  after ``max_num_gen_batches`` (> 0) batches without enough, the step fails as verl's does.
- Pure driver code: no Ray, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from verl_balance.batch_keys import INPUT_IDS_KEY, PROMPT_INDEX_KEY
from verl_balance.protocol import Batch

SCORE_METRICS = ("reward", "score", "seq_reward", "seq_final_reward")
KEY = "algorithm.filter_groups"


class DynamicSamplingError(RuntimeError):
    """Too many generation batches without a full train batch."""


def group_metric(metric: str, *, scores: np.ndarray, extras: Mapping[str, np.ndarray]) -> np.ndarray:
    """(B,) float64: the per-response values a group must vary in."""
    if metric in SCORE_METRICS:
        return np.asarray(scores, dtype=np.float64)
    if metric not in extras:
        raise ValueError(
            f"{KEY}.metric={metric!r}: the reward function returned no such field (its fields: "
            f"{sorted(extras)}; or one of {list(SCORE_METRICS)})"
        )
    return np.asarray(extras[metric], dtype=np.float64)


def kept_groups(prompt_index: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The sorted prompt indices whose group's values vary (population std > 0) or that have one response."""
    prompt_index = np.asarray(prompt_index)
    kept = [p for p in np.unique(prompt_index) if (group := values[prompt_index == p]).size == 1 or np.std(group) > 0]
    return np.asarray(kept, dtype=prompt_index.dtype)


def pad_columns(batch: Batch, *, width: int, pad_token_id: int) -> Batch:
    """The batch with every (B, L) tensor right-padded to ``width`` (input ids with the pad token, others 0)."""
    tensors = {}
    for key in batch.tensor_keys:
        t = batch[key]
        if t.dim() == 2 and t.shape[1] < width:
            value = pad_token_id if key == INPUT_IDS_KEY else 0
            t = torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)
        tensors[key] = t
    non_tensors = {k: batch[k] for k in batch.non_tensor_keys}
    return Batch.from_dict(tensors=tensors, non_tensors=non_tensors, meta=dict(batch.meta))


@dataclass
class GroupFilter:
    """Accumulates the kept groups of successive generation batches of one training step."""

    metric: str
    train_batch_size: int
    max_num_gen_batches: int
    pad_token_id: int
    parts: list = field(default_factory=list)
    num_gen_batches: int = 0
    num_prompts: int = 0

    def add(self, batch: Batch, *, scores: np.ndarray, extras: Mapping[str, np.ndarray]) -> bool:
        """Keep one batch's varying groups; True once the train batch is full. DynamicSamplingError past the limit."""
        self.num_gen_batches += 1
        prompt_index = np.asarray(batch[PROMPT_INDEX_KEY])
        groups = kept_groups(prompt_index, group_metric(self.metric, scores=scores, extras=extras))
        rows = np.flatnonzero(np.isin(prompt_index, groups))
        if rows.size:
            kept_extras = {k: np.asarray(v)[rows] for k, v in extras.items()}
            self.parts.append((batch.index_select(rows), np.asarray(scores)[rows], kept_extras))
        self.num_prompts += len(groups)
        if self.num_prompts >= self.train_batch_size:
            return True
        if 0 < self.max_num_gen_batches <= self.num_gen_batches:
            raise DynamicSamplingError(
                f"{KEY}: {self.num_gen_batches} generation batches kept {self.num_prompts} of the "
                f"{self.train_batch_size} prompts a step needs (max_num_gen_batches={self.max_num_gen_batches}); "
                f"the data may be too easy or too hard for {KEY}.metric={self.metric!r}: set "
                f"{KEY}.max_num_gen_batches=0 to keep generating"
            )
        return False

    def result(self) -> tuple[Batch, np.ndarray, dict[str, np.ndarray]]:
        """The first ``train_batch_size`` kept prompts (all their responses), prompt-major, renumbered."""
        assert self.num_prompts >= self.train_batch_size, "result() before the train batch is full"
        width = max(b[INPUT_IDS_KEY].shape[1] for b, _, _ in self.parts)
        batches, offset = [], 0
        for b, _, _ in self.parts:
            b = pad_columns(b, width=width, pad_token_id=self.pad_token_id)
            _, renumbered = np.unique(np.asarray(b[PROMPT_INDEX_KEY]), return_inverse=True)
            b[PROMPT_INDEX_KEY] = (renumbered + offset).astype(np.asarray(b[PROMPT_INDEX_KEY]).dtype)
            offset += int(renumbered.max()) + 1
            batches.append(b)
        batch = Batch.concat(batches)
        rows = np.flatnonzero(np.asarray(batch[PROMPT_INDEX_KEY]) < self.train_batch_size)
        scores = np.concatenate([s for _, s, _ in self.parts])[rows]
        extras = {k: np.concatenate([e[k] for _, _, e in self.parts])[rows] for k in self.parts[0][2]}
        return batch.index_select(rows), scores, extras

    def metrics(self) -> dict[str, float]:
        """verl's ``train/num_gen_batches`` and the kept share of the generated prompts."""
        return {"train/num_gen_batches": float(self.num_gen_batches)}


__all__ = ["DynamicSamplingError", "GroupFilter", "group_metric", "kept_groups", "pad_columns"]
