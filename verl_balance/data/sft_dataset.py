"""SFT dataset: parquet/jsonl rows -> token ids and a token-aligned loss mask, plus the collator.

Invariants (the "tensors on the wire" contract):
- ``loss_mask[t] == 1`` iff token t is a target, i.e. t lies in an assistant turn (its content and
  the end-of-turn token). Prompt tokens, chat scaffolding and padding have mask 0.
- Position 0 is never a target (nothing precedes it), also after left truncation.
- ``collate_sft`` right-pads to the longest sample: ``attention_mask`` is 1 on a contiguous
  prefix, ``position_ids`` count 0.. over real tokens and are 0 on padding.
- Rows are tokenized once, at construction, so every malformed row is reported (or counted and
  skipped) before training starts, and ``seq_lens`` is known up front for balancing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .io import (
    MALFORMED_POLICIES,
    TRUNCATION_MODES,
    DataError,
    MalformedRowError,
    SequenceTooLongError,
    as_file_list,
    check_choice,
    iter_rows,
)
from .tokenizer import Tokenizer, TokenizerError, validate_messages

logger = logging.getLogger(__name__)


@dataclass
class SFTDataConfig:
    """Which columns hold the data and how to treat long or malformed rows (verl's key names).

    With ``messages_key`` set, each row is a chat and every assistant turn is a target; otherwise
    ``prompt_key``/``response_key`` hold one user prompt and one assistant response.
    ``truncation``: error | left (drop the oldest tokens) | right (drop the newest tokens).
    ``on_malformed``: error | skip (count and drop the row, with a warning).
    """

    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str | None = None
    max_length: int = 1024
    truncation: str = "error"
    on_malformed: str = "error"

    def __post_init__(self):
        check_choice("truncation", self.truncation, TRUNCATION_MODES)
        check_choice("on_malformed", self.on_malformed, MALFORMED_POLICIES)
        if self.max_length < 2:
            raise DataError(f"max_length={self.max_length} is too small; need at least 2 tokens (context + target)")


def tokenize_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids of a chat and its loss mask (1 on every assistant turn's tokens).

    Each assistant turn k spans the tokens between the generation-prompted rendering of
    messages[:k] and the rendering of messages[:k+1]; both must be prefixes of the full rendering.
    """
    messages = validate_messages(messages)
    input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    loss_mask = [0] * len(input_ids)
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: k + 1], add_generation_prompt=False)
        if input_ids[: len(before)] != before or input_ids[: len(through)] != through:
            raise TokenizerError(
                f"the chat template is not prefix-stable at assistant message {k}; cannot locate its target tokens"
            )
        loss_mask[len(before) : len(through)] = [1] * (len(through) - len(before))
    return input_ids, loss_mask


def truncate(
    input_ids: list[int], loss_mask: list[int], *, max_length: int, truncation: str, where: str
) -> tuple[list[int], list[int]]:
    """Cut a sample to ``max_length`` tokens per the truncation mode; ``where`` names it in errors."""
    if len(input_ids) <= max_length:
        return input_ids, loss_mask
    if truncation == "left":
        return input_ids[-max_length:], loss_mask[-max_length:]
    if truncation == "right":
        return input_ids[:max_length], loss_mask[:max_length]
    raise SequenceTooLongError(
        f"{where}: {len(input_ids)} tokens > max_length={max_length}; raise max_length or set "
        "truncation to 'left' or 'right'"
    )


class SFTDataset(torch.utils.data.Dataset):
    """Tokenized SFT samples from parquet/jsonl files; item i -> {"input_ids", "loss_mask"} (1-D long)."""

    def __init__(self, *, files: Any, tokenizer: Tokenizer, config: SFTDataConfig | None = None):
        self.config = config = config or SFTDataConfig()
        self.tokenizer = tokenizer
        self.files = as_file_list(files)
        self._input_ids: list[np.ndarray] = []
        self._loss_mask: list[np.ndarray] = []
        self._origin: list[tuple[str, int]] = []
        self.skipped: list[MalformedRowError] = []
        self.num_truncated = 0
        self.num_without_targets = 0
        for path in self.files:
            self._read_file(path)
        if self.skipped:
            logger.warning(
                "skipped %d malformed row(s) (on_malformed=skip); first: %s", len(self.skipped), self.skipped[0]
            )
        if self.num_truncated:
            logger.warning(
                "truncated %d sample(s) to max_length=%d (truncation=%s); %d of them kept no target token",
                self.num_truncated, config.max_length, config.truncation, self.num_without_targets,
            )
        if not self._input_ids:
            raise DataError(f"no usable rows in {self.files} ({len(self.skipped)} malformed rows skipped)")

    @property
    def columns(self) -> list[str]:
        """The columns read from every file."""
        if self.config.messages_key is not None:
            return [self.config.messages_key]
        return [self.config.prompt_key, self.config.response_key]

    def _messages_of(self, row: dict[str, Any] | str) -> list[dict[str, str]]:
        """The chat of one row, or raise ValueError with the reason it is malformed."""
        if isinstance(row, str):
            raise ValueError(row)
        for key in self.columns:
            if row.get(key) is None:
                raise ValueError(f"missing or null key {key!r}")
        if self.config.messages_key is not None:
            messages = validate_messages(row[self.config.messages_key])
            assistant_turns = [m["content"] for m in messages if m["role"] == "assistant"]
            if not assistant_turns:
                raise ValueError(f"{self.config.messages_key!r} has no assistant message to train on")
            if any(not content for content in assistant_turns):
                raise ValueError(f"{self.config.messages_key!r} has an empty assistant message")
            return messages
        prompt, response = row[self.config.prompt_key], row[self.config.response_key]
        for key, value in ((self.config.prompt_key, prompt), (self.config.response_key, response)):
            if not isinstance(value, str):
                raise ValueError(f"key {key!r} must be a string, got {type(value).__name__}")
        if not response:
            raise ValueError(f"key {self.config.response_key!r} is an empty string")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]

    def _read_file(self, path: str) -> None:
        for row_index, row in iter_rows(path, columns=self.columns):
            try:
                messages = self._messages_of(row)
            except ValueError as err:  # TokenizerError is a ValueError too
                error = MalformedRowError(path, row_index, str(err), hint="fix the row or set on_malformed=skip")
                if self.config.on_malformed == "error":
                    raise error from None
                self.skipped.append(error)
                continue
            try:
                input_ids, loss_mask = tokenize_chat(self.tokenizer, messages)
            except TokenizerError as err:
                raise DataError(f"{path}: row {row_index}: {err}") from err
            if len(input_ids) > self.config.max_length:
                self.num_truncated += 1
            input_ids, loss_mask = truncate(
                input_ids, loss_mask, max_length=self.config.max_length, truncation=self.config.truncation,
                where=f"{path}: row {row_index}",
            )
            loss_mask[0] = 0
            self.num_without_targets += not any(loss_mask)
            self._input_ids.append(np.asarray(input_ids, dtype=np.int64))
            self._loss_mask.append(np.asarray(loss_mask, dtype=np.int64))
            self._origin.append((path, row_index))

    def __len__(self) -> int:
        return len(self._input_ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": torch.from_numpy(self._input_ids[index]),
            "loss_mask": torch.from_numpy(self._loss_mask[index]),
        }

    @property
    def seq_lens(self) -> np.ndarray:
        """Token count of every sample (int64), for balancing and dynamic micro-batches."""
        return np.array([len(ids) for ids in self._input_ids], dtype=np.int64)

    @property
    def num_loss_tokens(self) -> np.ndarray:
        """Target-token count of every sample (int64)."""
        return np.array([int(mask.sum()) for mask in self._loss_mask], dtype=np.int64)

    def origin(self, index: int) -> tuple[str, int]:
        """(file, row) a sample came from, for error messages."""
        return self._origin[index]

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``collate_sft`` with this dataset's tokenizer's pad id."""
        return collate_sft(samples, pad_token_id=self.tokenizer.pad_token_id)


def collate_sft(samples: Sequence[Mapping[str, torch.Tensor]], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad samples to (B, L): input_ids, attention_mask, loss_mask, position_ids (all int64)."""
    if not samples:
        raise DataError("cannot collate an empty list of samples")
    lengths = [len(s["input_ids"]) for s in samples]
    batch_size, max_len = len(samples), max(lengths)
    input_ids = torch.full((batch_size, max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, max_len), dtype=torch.long)
    loss_mask = torch.zeros((batch_size, max_len), dtype=torch.long)
    position_ids = torch.zeros((batch_size, max_len), dtype=torch.long)
    for i, (sample, length) in enumerate(zip(samples, lengths)):
        input_ids[i, :length] = sample["input_ids"]
        loss_mask[i, :length] = sample["loss_mask"]
        attention_mask[i, :length] = 1
        position_ids[i, :length] = torch.arange(length)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "loss_mask": loss_mask,
        "position_ids": position_ids,
    }
