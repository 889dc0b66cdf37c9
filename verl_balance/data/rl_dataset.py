"""RL prompt dataset (verl's RL parquet schema) and its collator.

Row schema: ``data_source`` (str), ``prompt`` (list of {"role", "content"}, or a string taken as one
user message), ``reward_model`` ({"style": ..., "ground_truth": ...}), optional ``extra_info`` (dict).
Prompts are tokenized with the generation prompt appended.

Invariants: every row is kept, filtered as over-long (``num_filtered``) or skipped as malformed
(``skipped``); nothing is dropped uncounted. Kept prompts have at most ``max_prompt_length`` tokens.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import pickle
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl_balance.batch_keys import ATTENTION_MASK_KEY, INDEX_KEY, INPUT_IDS_KEY, POSITION_IDS_KEY, PROMPT_IDS_KEY

from .io import (
    MALFORMED_POLICIES,
    TRUNCATION_MODES,
    DataError,
    MalformedRowError,
    SequenceTooLongError,
    as_file_list,
    check_choice,
    collect_young_garbage,
    find_invalid_text,
    gc_paused,
    iter_rows,
)
from .tokenizer import Tokenizer, validate_messages

# verl's per-sample agent loop column (its multi-turn datasets); optional, absent in single-turn data.
AGENT_NAME_COLUMN = "agent_name"

logger = logging.getLogger(__name__)


@dataclass
class RLDataConfig:
    """Columns and length policy of the RL prompt data (verl's key names). Over-long prompts are dropped
    when ``filter_overlong_prompts``, else ``truncation``: error | left (keep the end) | right (keep the start)."""

    prompt_key: str = "prompt"
    data_source_key: str = "data_source"
    reward_model_key: str = "reward_model"
    extra_info_key: str = "extra_info"
    max_prompt_length: int = 512
    filter_overlong_prompts: bool = True
    truncation: str = "error"
    on_malformed: str = "error"

    def __post_init__(self):
        check_choice("truncation", self.truncation, TRUNCATION_MODES)
        check_choice("on_malformed", self.on_malformed, MALFORMED_POLICIES)
        if self.max_prompt_length < 1:
            raise DataError(f"max_prompt_length={self.max_prompt_length} must be >= 1")


@dataclass(frozen=True)
class RLPrompt:
    """One prompt: its token ids, chat, reward target and provenance."""

    prompt_ids: np.ndarray
    raw_prompt: list[dict[str, str]]
    data_source: str
    ground_truth: Any
    reward_model: dict[str, Any]
    extra_info: dict[str, Any]
    index: int
    agent_name: str | None = None  # verl's agent_name column: tool_agent / single_turn_agent (multi-turn)


class RLPromptDataset(torch.utils.data.Dataset):
    """Prompts with ground truth and data_source; item i -> ``RLPrompt``."""

    def __init__(self, *, files: Any, tokenizer: Tokenizer, config: RLDataConfig | None = None):
        self.config = config = config or RLDataConfig()
        self.tokenizer = tokenizer
        self.files = as_file_list(files)
        self._prompt_ids = array("H" if tokenizer.vocab_size <= 1 << 16 else "i")
        self._offsets = array("q", [0])
        self._records = bytearray()  # pickled (raw_prompt, data_source, reward_model, extra_info) per prompt
        self._record_offsets = array("q", [0])
        self._file_index = array("i")
        self._row = array("q")
        self._fingerprint: str | None = None
        self.skipped: list[MalformedRowError] = []
        self.data_source_rows: dict[str, tuple[str, int]] = {}
        """Each data_source of the kept prompts -> (file, row) of its first prompt."""
        self.num_filtered = 0
        self.num_truncated = 0
        with gc_paused():
            for file_index, path in enumerate(self.files):
                self._read_file(path, file_index)
        if self.skipped:
            logger.warning(
                "skipped %d malformed row(s) (on_malformed=skip); first: %s", len(self.skipped), self.skipped[0]
            )
        if self.num_filtered:
            logger.warning(
                "filtered %d prompt(s) longer than max_prompt_length=%d (filter_overlong_prompts=True)",
                self.num_filtered,
                config.max_prompt_length,
            )
        if not len(self):
            raise DataError(
                f"no usable prompts in {self.files}: {self.num_filtered} longer than "
                f"data.max_prompt_length={config.max_prompt_length} (filtered), {len(self.skipped)} malformed"
                + ("; raise data.max_prompt_length" if self.num_filtered else "")
            )

    def _parse(self, row: dict[str, Any] | str) -> tuple[list[dict[str, str]], str, dict[str, Any], dict[str, Any]]:
        """(messages, data_source, reward_model, extra_info) of a row, or ValueError with the reason."""
        config = self.config
        if isinstance(row, str):
            raise ValueError(row)
        for key in (config.prompt_key, config.data_source_key, config.reward_model_key):
            if row.get(key) is None:
                raise ValueError(f"missing or null key {key!r}")
        prompt = row[config.prompt_key]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else validate_messages(prompt)
        if not messages:
            raise ValueError(f"key {config.prompt_key!r} is an empty chat")
        data_source = row[config.data_source_key]
        if not isinstance(data_source, str):
            raise ValueError(f"key {config.data_source_key!r} must be a string, got {type(data_source).__name__}")
        reward_model = row[config.reward_model_key]
        if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
            raise ValueError(f"key {config.reward_model_key!r} must be a dict with a non-null 'ground_truth'")
        extra_info = row.get(config.extra_info_key) or {}
        if not isinstance(extra_info, Mapping):
            raise ValueError(f"key {config.extra_info_key!r} must be a dict, got {type(extra_info).__name__}")
        return messages, data_source, dict(reward_model), dict(extra_info)

    def _malformed(self, path: str, row_index: int, reason: str) -> None:
        error = MalformedRowError(path, row_index, reason, hint="fix the row or set on_malformed=skip")
        if self.config.on_malformed == "error":
            raise error from None
        self.skipped.append(error)

    def _read_file(self, path: str, file_index: int) -> None:
        config = self.config
        columns = [config.prompt_key, config.data_source_key, config.reward_model_key]
        optional = [config.extra_info_key, AGENT_NAME_COLUMN]
        for row_index, row in iter_rows(path, columns=columns, optional_columns=optional):
            if row_index % 1024 == 1023:
                collect_young_garbage()
            try:
                messages, data_source, reward_model, extra_info = self._parse(row)
            except ValueError as err:
                self._malformed(path, row_index, str(err))
                continue
            try:
                prompt_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            except UnicodeError as err:
                self._malformed(path, row_index, find_invalid_text(messages) or f"text is not valid Unicode ({err})")
                continue
            if len(prompt_ids) > config.max_prompt_length:
                if config.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                self.num_truncated += 1
                if config.truncation == "left":
                    prompt_ids = prompt_ids[-config.max_prompt_length :]
                elif config.truncation == "right":
                    prompt_ids = prompt_ids[: config.max_prompt_length]
                else:
                    raise SequenceTooLongError(
                        f"{path}: row {row_index}: prompt has {len(prompt_ids)} tokens > data.max_prompt_length="
                        f"{config.max_prompt_length}; raise data.max_prompt_length, set "
                        "data.filter_overlong_prompts=true, or data.truncation to 'left' or 'right'"
                    )
            try:
                ids = array(self._prompt_ids.typecode, prompt_ids)
            except OverflowError as err:
                raise DataError(
                    f"{path}: row {row_index}: the tokenizer returned a token id outside "
                    f"[0, vocab_size={self.tokenizer.vocab_size}) ({err})"
                ) from None
            self._prompt_ids += ids
            self._offsets.append(len(self._prompt_ids))
            record = (messages, data_source, reward_model, extra_info)
            if isinstance(row, dict) and row.get(AGENT_NAME_COLUMN) is not None:
                record += (str(row[AGENT_NAME_COLUMN]),)  # verl's per-sample agent loop
            self._records += pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
            self._record_offsets.append(len(self._records))
            self._file_index.append(file_index)
            self._row.append(row_index)
            self.data_source_rows.setdefault(data_source, (path, row_index))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> RLPrompt:
        index = operator.index(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"prompt index {index} is out of range for {len(self)} prompts")
        record = memoryview(self._records)[self._record_offsets[index] : self._record_offsets[index + 1]]
        messages, data_source, reward_model, extra_info, *agent_name = pickle.loads(record)
        start, end = self._offsets[index], self._offsets[index + 1]
        return RLPrompt(
            prompt_ids=np.asarray(self._prompt_ids[start:end], dtype=np.int64),
            raw_prompt=messages,
            data_source=data_source,
            ground_truth=reward_model["ground_truth"],
            reward_model=reward_model,
            extra_info=extra_info,
            index=index,
            agent_name=agent_name[0] if agent_name else None,
        )

    @property
    def prompt_lens(self) -> np.ndarray:
        """Token count of every prompt (int64)."""
        return np.diff(np.frombuffer(self._offsets, dtype=np.int64))

    def origin(self, index: int) -> tuple[str, int]:
        """(file, row) a prompt came from, for error messages."""
        return self.files[self._file_index[index]], self._row[index]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers that hold the prompts (ids, offsets, pickled records, origins)."""
        return sum(
            memoryview(b).nbytes
            for b in (self._prompt_ids, self._offsets, self._records, self._record_offsets, self._file_index, self._row)
        )

    def fingerprint(self) -> str:
        """A hash of every prompt's token ids and record (chat, data_source, reward, extra_info); see the loader."""
        if self._fingerprint is None:
            digest = hashlib.blake2b(digest_size=16)
            for part in (self._offsets, self._prompt_ids, self._record_offsets, self._records):
                digest.update(memoryview(part).cast("B"))
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def collate(self, samples: Sequence[RLPrompt]) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
        """``collate_rl`` with this dataset's tokenizer's pad id."""
        return collate_rl(samples, pad_token_id=self.tokenizer.pad_token_id)


def _object_array(values: Sequence[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array


def collate_rl(
    samples: Sequence[RLPrompt], *, pad_token_id: int
) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Prompts -> (tensors, non_tensors) for ``Batch.from_dict``.

    tensors: right-padded (B, Lp) int64 ``input_ids``, ``attention_mask``, ``position_ids``.
    non_tensors (object arrays, verl's names): ``raw_prompt_ids``, ``raw_prompt``, ``data_source``,
    ``ground_truth``, ``reward_model``, ``extra_info``, ``index``, ``agent_name``.
    """
    if not samples:
        raise DataError("cannot collate an empty list of prompts")
    lengths = [len(s.prompt_ids) for s in samples]
    batch_size, max_len = len(samples), max(lengths)
    input_ids = torch.full((batch_size, max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, max_len), dtype=torch.long)
    position_ids = torch.zeros((batch_size, max_len), dtype=torch.long)
    for i, (sample, length) in enumerate(zip(samples, lengths)):
        input_ids[i, :length] = torch.from_numpy(sample.prompt_ids)
        attention_mask[i, :length] = 1
        position_ids[i, :length] = torch.arange(length)
    tensors = {INPUT_IDS_KEY: input_ids, ATTENTION_MASK_KEY: attention_mask, POSITION_IDS_KEY: position_ids}
    non_tensors = {
        PROMPT_IDS_KEY: _object_array([s.prompt_ids.tolist() for s in samples]),
        "raw_prompt": _object_array([s.raw_prompt for s in samples]),
        "data_source": _object_array([s.data_source for s in samples]),
        "ground_truth": _object_array([s.ground_truth for s in samples]),
        "reward_model": _object_array([s.reward_model for s in samples]),
        "extra_info": _object_array([s.extra_info for s in samples]),
        INDEX_KEY: _object_array([s.index for s in samples]),
        AGENT_NAME_COLUMN: _object_array([s.agent_name for s in samples]),
    }
    return tensors, non_tensors
