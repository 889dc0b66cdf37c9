"""SFT dataset: parquet/jsonl rows -> token ids and a token-aligned loss mask, plus the collator.

Invariants:
- ``loss_mask[t] == 1`` iff token t lies in an assistant turn (its content and end-of-turn token);
  prompt tokens, chat scaffolding and padding have mask 0. Position 0 is never a target.
- ``collate_sft`` right-pads to the longest sample: ``attention_mask`` is 1 on a contiguous
  prefix, ``position_ids`` count 0.. over real tokens and are 0 on padding.
- Rows are tokenized once, at construction: every malformed row is reported (or skipped) before
  training, and ``seq_lens`` is known up front. Samples live in flat arrays (about 3-5 bytes a token).
"""

from __future__ import annotations

import hashlib
import logging
import operator
import os
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from verl_balance.batch_keys import ATTENTION_MASK_KEY, INPUT_IDS_KEY, LOSS_MASK_KEY, POSITION_IDS_KEY

from .io import (
    MALFORMED_POLICIES,
    TRUNCATION_MODES,
    DataError,
    MalformedRowError,
    SequenceTooLongError,
    as_file_list,
    check_choice,
    collect_young_garbage,
    file_columns,
    find_invalid_text,
    gc_paused,
    iter_rows,
    num_rows_hint,
)
from .tokenizer import Tokenizer, TokenizerError, validate_messages, validate_tools

logger = logging.getLogger(__name__)

ROWS_PER_CHUNK = 1024
PROGRESS_MIN_ROWS = 50_000  # a tqdm bar for files at least this long (or this many bytes x 1000 of jsonl)
Span = tuple[int, int]
Chat = tuple[list[dict[str, Any]], list[dict[str, Any]] | None]
"""A validated chat: its messages and its tool schemas (None: no tools)."""


@dataclass
class SFTDataConfig:
    """Which columns hold the data and how to treat long or malformed rows (verl's key names);
    ``chat_column`` picks chat or prompt/response columns per file."""

    prompt_key: str = "prompt"
    """Column of the user prompt (a string) in a file read as prompt/response."""
    response_key: str = "response"
    """Column of the assistant response (a non-empty string) in a file read as prompt/response."""
    messages_key: str | None = None
    """Column of a chat (a list of {"role", "content"}); every assistant turn is a target. Null: verl's
    default ``messages`` where present, else prompt_key/response_key. verl's tool format is read too
    (assistant ``tool_calls`` are targets, ``tool`` messages never are)."""
    tools_key: str = "tools"
    """verl's key: the column of a chat row's tool schemas (a list of OpenAI function schemas, or null),
    passed to the chat template as ``tools=``; read when the file has it."""
    max_length: int = 1024
    """Most tokens a sample may have after the chat template; longer ones follow ``truncation``."""
    truncation: str = "error"
    """error (a too-long sample stops the load, naming file and row) | left (drop the oldest tokens) |
    right (drop the newest tokens)."""
    on_malformed: str = "error"
    """error (stop at the first malformed row, naming file and row) | skip (count and drop it, with a warning).
    Malformed: a missing/null/mistyped key, an empty target, a line that is not a JSON object, or text
    that is not valid Unicode (a non-UTF-8 byte, a lone surrogate)."""

    def __post_init__(self):
        check_choice("truncation", self.truncation, TRUNCATION_MODES)
        check_choice("on_malformed", self.on_malformed, MALFORMED_POLICIES)
        if self.max_length < 2:
            raise DataError(f"max_length={self.max_length} is too small; need at least 2 tokens (context + target)")


DEFAULT_MESSAGES_KEY = "messages"
"""verl's sft_trainer default of ``data.messages_key``: read when ``messages_key`` is unset and the file has it."""


def chat_column(config: SFTDataConfig, *, path: str) -> str | None:
    """The chat column ``config`` reads from the file at ``path``; None: its prompt/response columns.
    A set ``messages_key`` must be a column; a file matching no rule is a DataError naming the columns."""
    columns = file_columns(path)
    if config.messages_key is not None:
        if config.messages_key in columns:
            return config.messages_key
        raise DataError(
            f"{path}: data.messages_key={config.messages_key!r} is not a column; columns present: {columns}; "
            "set data.messages_key to the file's chat column, or remove it to read verl's default "
            f"{DEFAULT_MESSAGES_KEY!r} or else data.prompt_key/data.response_key"
        )
    if DEFAULT_MESSAGES_KEY in columns:
        return DEFAULT_MESSAGES_KEY
    missing = [key for key in (config.prompt_key, config.response_key) if key not in columns]
    if not missing:
        return None
    raise DataError(
        f"{path}: missing column(s) {missing} (data.prompt_key/data.response_key) and no "
        f"{DEFAULT_MESSAGES_KEY!r} column (data.messages_key, unset: verl's default); columns present: "
        f"{columns}; set data.messages_key to the file's chat column, or data.prompt_key and "
        "data.response_key to its prompt and response columns"
    )


def tokenize_chat(
    tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping] | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of a chat and its loss mask (1 on every assistant turn's tokens, tool calls included).

    Assistant turn k spans from the generation-prompted rendering of messages[:k] to that of
    messages[:k+1]; both must be prefixes of the full rendering.
    """
    chat = (validate_messages(messages), validate_tools(tools))
    (result,) = _tokenize_chats(tokenizer, [chat])
    if isinstance(result, Exception):
        raise result
    input_ids, spans = result
    return input_ids, _mask_list(len(input_ids), spans)


def _mask_list(length: int, spans: Sequence[Span]) -> list[int]:
    mask = [0] * length
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    return mask


def _render_many(tokenizer: Tokenizer, requests: Sequence[tuple[Chat, bool]]) -> list[Any]:
    """``apply_chat_template`` of every ((messages, tools), add_generation_prompt); a failed one yields
    its exception. Batches via ``apply_chat_template_batch`` when the tokenizer has it."""
    rendered: list[Any] = [None] * len(requests)
    render_batch = getattr(tokenizer, "apply_chat_template_batch", None)
    if render_batch is not None:
        for flag in (False, True):
            where = [i for i, ((_, tools), generation) in enumerate(requests) if generation is flag and not tools]
            if not where:
                continue
            try:
                ids_list = render_batch([requests[i][0][0] for i in where], add_generation_prompt=flag)
            except ValueError:
                continue
            for i, ids in zip(where, ids_list):
                rendered[i] = list(ids)
    for i, ((messages, tools), generation) in enumerate(requests):
        if rendered[i] is None:
            extra = {"tools": tools} if tools else {}
            try:
                rendered[i] = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, **extra)
            except ValueError as err:  # UnicodeError, TokenizerError
                rendered[i] = err
    return rendered


def _tokenize_chats(tokenizer: Tokenizer, chats: Sequence[Chat]) -> list[Any]:
    """(input_ids, target spans) of every validated chat, or the exception that chat raised."""
    requests: list[tuple[Chat, bool]] = []
    layout = []  # per chat: (index of the full rendering, [(assistant turn, before index, through index)])
    for messages, tools in chats:
        full = len(requests)
        requests.append(((messages, tools), False))
        turns = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = len(requests)
            requests.append(((messages[:k], tools), True))
            through = full
            if k != len(messages) - 1:
                through = len(requests)
                requests.append(((messages[: k + 1], tools), False))
            turns.append((k, before, through))
        layout.append((full, turns))
    rendered = _render_many(tokenizer, requests)
    return [_spans_of(rendered, full, turns) for full, turns in layout]


def _spans_of(rendered: list[Any], full: int, turns: list[tuple[int, int, int]]) -> Any:
    """(input_ids, target spans) of one chat from its renderings, or the exception it raised."""
    input_ids = rendered[full]
    if isinstance(input_ids, Exception):
        return input_ids
    spans: list[Span] = []
    for k, before_index, through_index in turns:
        before, through = rendered[before_index], rendered[through_index]
        for part in (before, through):
            if isinstance(part, Exception):
                return part
        if input_ids[: len(before)] != before or not (through is input_ids or input_ids[: len(through)] == through):
            return TokenizerError(
                f"the chat template is not prefix-stable at assistant message {k}; cannot locate its target tokens"
            )
        spans.append((len(before), len(through)))
    return input_ids, spans


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
    raise _too_long(len(input_ids), max_length=max_length, where=where)


def _too_long(length: int, *, max_length: int, where: str) -> SequenceTooLongError:
    return SequenceTooLongError(
        f"{where}: {length} tokens > max_length={max_length}; raise max_length or set truncation to 'left' or 'right'"
    )


def _truncate_spans(
    input_ids: list[int], spans: list[Span], *, max_length: int, truncation: str, where: str
) -> tuple[list[int], list[Span]]:
    """``truncate`` on target spans instead of a mask list."""
    length = len(input_ids)
    if length <= max_length:
        return input_ids, spans
    if truncation == "left":
        shift = length - max_length
        spans = [(max(start - shift, 0), end - shift) for start, end in spans if end > shift]
        return input_ids[shift:], spans
    if truncation == "right":
        return input_ids[:max_length], [(start, min(end, max_length)) for start, end in spans if start < max_length]
    raise _too_long(length, max_length=max_length, where=where)


class TokenIdError(Exception):
    """A token id that does not fit the store's id dtype (internal; re-raised as DataError naming the row)."""

    def __init__(self, row: int, reason: str):
        self.row, self.reason = row, reason
        super().__init__(row, reason)


class _SampleStore:
    """Growable flat storage of samples: token ids, uint8 loss mask, offsets, origin (file, row)."""

    def __init__(self, *, vocab_size: int):
        self.id_typecode = "H" if vocab_size <= 1 << 16 else "i"
        assert array(self.id_typecode).itemsize in (2, 4)
        self.token_ids = array(self.id_typecode)
        self.loss_mask = bytearray()
        self.offsets = array("q", [0])
        self.loss_tokens = array("q")
        self.file_index = array("i")
        self.row = array("q")

    def append_chunk(self, samples: Sequence[tuple[list[int], Sequence[Span], int]], *, file_index: int) -> None:
        """Add (input_ids, target spans, row) samples; TokenIdError for an id outside the id dtype."""
        flat_ids: list[int] = []
        span_starts: list[int] = []
        span_stops: list[int] = []
        end = len(self.token_ids)
        offsets, loss_tokens, rows = [], [], []
        for input_ids, spans, row in samples:
            chunk_pos = len(flat_ids)
            flat_ids += input_ids
            count = 0
            for start, stop in spans:
                span_starts.append(chunk_pos + start)
                span_stops.append(chunk_pos + stop)
                count += stop - start
            offsets.append(end + len(flat_ids))
            loss_tokens.append(count)
            rows.append(row)
        try:
            chunk_ids = array(self.id_typecode, flat_ids)
        except (OverflowError, TypeError):
            for input_ids, _, row in samples:
                try:
                    array(self.id_typecode, input_ids)
                except (OverflowError, TypeError) as err:
                    raise TokenIdError(row, str(err)) from None
            raise
        # Loss mask of the whole chunk at once: +1 at each span start, -1 at its stop, running sum.
        edges = np.zeros(len(flat_ids) + 1, dtype=np.int32)
        np.add.at(edges, np.asarray(span_starts, dtype=np.int64), 1)
        np.add.at(edges, np.asarray(span_stops, dtype=np.int64), -1)
        self.loss_mask += (np.cumsum(edges[:-1]) > 0).view(np.uint8).data
        self.token_ids += chunk_ids
        self.offsets.extend(offsets)
        self.loss_tokens.extend(loss_tokens)
        self.row.extend(rows)
        self.file_index.extend([file_index] * len(samples))

    def arrays(self) -> dict[str, np.ndarray]:
        """Read-only numpy views of the buffers (no copy)."""
        views = {
            "token_ids": np.frombuffer(self.token_ids, dtype=np.uint16 if self.id_typecode == "H" else np.int32),
            LOSS_MASK_KEY: np.frombuffer(self.loss_mask, dtype=np.uint8),
            "offsets": np.frombuffer(self.offsets, dtype=np.int64),
            "loss_tokens": np.frombuffer(self.loss_tokens, dtype=np.int64),
            "file_index": np.frombuffer(self.file_index, dtype=np.int32),
            "row": np.frombuffer(self.row, dtype=np.int64),
        }
        for view in views.values():
            view.flags.writeable = False
        return views


class SFTDataset(torch.utils.data.Dataset):
    """Tokenized SFT samples from parquet/jsonl files; item i -> {"input_ids", "loss_mask"} (1-D long)."""

    def __init__(self, *, files: Any, tokenizer: Tokenizer, config: SFTDataConfig | None = None):
        self.config = config = config or SFTDataConfig()
        self.tokenizer = tokenizer
        self.files = as_file_list(files)
        self.skipped: list[MalformedRowError] = []
        self.num_truncated = 0
        self.num_without_targets = 0
        self._fingerprint: str | None = None
        self.chat_columns = [chat_column(config, path=path) for path in self.files]
        """Per file: the chat column read (``chat_column``), or None for its prompt/response columns."""
        store = _SampleStore(vocab_size=tokenizer.vocab_size)
        with gc_paused():
            for file_index, path in enumerate(self.files):
                self._read_file(path, file_index, store)
        arrays = store.arrays()
        self._token_ids, self._loss_mask, self._offsets = arrays["token_ids"], arrays[LOSS_MASK_KEY], arrays["offsets"]
        self._loss_tokens, self._file_index, self._row = arrays["loss_tokens"], arrays["file_index"], arrays["row"]
        if self.skipped:
            logger.warning(
                "skipped %d malformed row(s) (on_malformed=skip); first: %s", len(self.skipped), self.skipped[0]
            )
        if self.num_truncated:
            logger.warning(
                "truncated %d sample(s) to max_length=%d (truncation=%s); %d of them kept no target token",
                self.num_truncated,
                config.max_length,
                config.truncation,
                self.num_without_targets,
            )
        if len(self) == 0:
            raise DataError(f"no usable rows in {self.files} ({len(self.skipped)} malformed rows skipped)")
        self._check_vocab()
        logger.info(
            "SFT dataset: %d samples, %d tokens, %.1f MB in memory", len(self), len(self._token_ids), self.nbytes / 1e6
        )

    def columns_of(self, file_index: int) -> list[str]:
        """The columns read from file ``file_index``: its chat column, or its prompt and response columns."""
        chat = self.chat_columns[file_index]
        return [chat] if chat is not None else [self.config.prompt_key, self.config.response_key]

    def _messages_of(self, row: dict[str, Any] | str, *, file_index: int) -> Chat:
        """The chat (messages, tools) of one row of file ``file_index``, or raise ValueError with the reason
        it is malformed."""
        if isinstance(row, str):
            raise ValueError(row)
        chat = self.chat_columns[file_index]
        for key in self.columns_of(file_index):
            if row.get(key) is None:
                raise ValueError(f"missing or null key {key!r}")
        if chat is not None:
            messages = validate_messages(row[chat])
            assistant_turns = [m for m in messages if m["role"] == "assistant"]
            if not assistant_turns:
                raise ValueError(f"{chat!r} has no assistant message to train on")
            if any(not m["content"] and not m.get("tool_calls") for m in assistant_turns):
                raise ValueError(f"{chat!r} has an empty assistant message")
            tools_key = self.config.tools_key
            try:
                tools = validate_tools(row.get(tools_key))
            except TokenizerError as err:
                raise ValueError(f"column {tools_key!r} (data.tools_key): {err}") from None
            return messages, tools
        prompt, response = row[self.config.prompt_key], row[self.config.response_key]
        for key, value in ((self.config.prompt_key, prompt), (self.config.response_key, response)):
            if not isinstance(value, str):
                raise ValueError(f"key {key!r} must be a string, got {type(value).__name__}")
        if not response:
            raise ValueError(f"key {self.config.response_key!r} is an empty string")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], None

    def _malformed(self, path: str, row_index: int, reason: str) -> None:
        error = MalformedRowError(path, row_index, reason, hint="fix the row or set on_malformed=skip")
        if self.config.on_malformed == "error":
            raise error from None
        self.skipped.append(error)

    def _read_file(self, path: str, file_index: int, store: _SampleStore) -> None:
        from tqdm import tqdm

        total = num_rows_hint(path)
        large = (total or 0) >= PROGRESS_MIN_ROWS or os.path.getsize(path) >= 1000 * PROGRESS_MIN_ROWS
        chunk: list[tuple[int, dict[str, Any] | str]] = []
        with tqdm(
            total=total, desc=f"tokenizing {os.path.basename(path)}", unit="row", disable=not large, mininterval=2.0
        ) as progress:
            optional = (self.config.tools_key,) if self.chat_columns[file_index] is not None else ()
            for row_index, row in iter_rows(path, columns=self.columns_of(file_index), optional_columns=optional):
                chunk.append((row_index, row))
                if len(chunk) == ROWS_PER_CHUNK:
                    self._add_chunk(path, file_index, chunk, store)
                    progress.update(len(chunk))
                    chunk = []
                    collect_young_garbage()
            if chunk:
                self._add_chunk(path, file_index, chunk, store)
                progress.update(len(chunk))

    def _add_chunk(self, path: str, file_index: int, chunk: list, store: _SampleStore) -> None:
        """Tokenize a chunk of rows together, then add or report them in row order."""
        parsed: list[tuple[int, Any]] = []
        for row_index, row in chunk:
            try:
                parsed.append((row_index, self._messages_of(row, file_index=file_index)))
            except ValueError as err:  # TokenizerError is a ValueError too
                parsed.append((row_index, err))
        chats = [messages for _, messages in parsed if not isinstance(messages, Exception)]
        tokenized = iter(_tokenize_chats(self.tokenizer, chats))
        config = self.config
        samples = []
        for row_index, messages in parsed:
            where = f"{path}: row {row_index}"
            if isinstance(messages, Exception):
                self._malformed(path, row_index, str(messages))
                continue
            result = next(tokenized)
            if isinstance(result, UnicodeError):
                self._malformed(path, row_index, find_invalid_text(messages) or f"text is not valid Unicode ({result})")
                continue
            if isinstance(result, Exception):
                raise DataError(f"{where}: {result}") from result
            input_ids, spans = result
            if len(input_ids) > config.max_length:
                self.num_truncated += 1
            input_ids, spans = _truncate_spans(
                input_ids, spans, max_length=config.max_length, truncation=config.truncation, where=where
            )
            spans = [(max(start, 1), end) for start, end in spans if end > 1]  # position 0 is never a target
            self.num_without_targets += not spans
            samples.append((input_ids, spans, row_index))
        try:
            store.append_chunk(samples, file_index=file_index)
        except TokenIdError as err:
            raise DataError(
                f"{path}: row {err.row}: the tokenizer returned a token id outside "
                f"[0, vocab_size={self.tokenizer.vocab_size}) ({err.reason})"
            ) from None

    def _check_vocab(self) -> None:
        """Raise DataError naming file and row of the first token id outside [0, vocab_size)."""
        ids, vocab_size = self._token_ids, self.tokenizer.vocab_size
        if not len(ids) or (int(ids.max()) < vocab_size and int(ids.min()) >= 0):
            return
        step = 1 << 24  # bounded temporaries on a large store
        first = next(
            start + int(np.argmax(outside))
            for start in range(0, len(ids), step)
            for outside in [(ids[start : start + step] >= vocab_size) | (ids[start : start + step] < 0)]
            if outside.any()
        )
        path, row = self.origin(int(np.searchsorted(self._offsets, first, side="right")) - 1)
        raise DataError(
            f"{path}: row {row}: token id {int(ids[first])} is outside the tokenizer's vocab [0, {vocab_size})"
        )

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def _check_index(self, index: int) -> int:
        index = operator.index(index)
        size = len(self)
        if index < 0:
            index += size
        if not 0 <= index < size:
            raise IndexError(f"sample index {index} is out of range for {size} samples")
        return index

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = self._check_index(index)
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        return {
            INPUT_IDS_KEY: torch.from_numpy(self._token_ids[start:end].astype(np.int64)),
            LOSS_MASK_KEY: torch.from_numpy(self._loss_mask[start:end].astype(np.int64)),
        }

    @property
    def seq_lens(self) -> np.ndarray:
        """Token count of every sample (int64), for balancing and dynamic micro-batches."""
        return np.diff(self._offsets)

    @property
    def num_loss_tokens(self) -> np.ndarray:
        """Target-token count of every sample (int64)."""
        return self._loss_tokens.copy()

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays that hold the samples (ids, mask, offsets, per-sample counts and origins)."""
        return sum(
            a.nbytes
            for a in (self._token_ids, self._loss_mask, self._offsets, self._loss_tokens, self._file_index, self._row)
        )

    def origin(self, index: int) -> tuple[str, int]:
        """(file, row) a sample came from, for error messages."""
        index = self._check_index(index)
        return self.files[int(self._file_index[index])], int(self._row[index])

    def fingerprint(self) -> str:
        """A hash of every sample's tokens and loss mask: equal iff the data would train identically
        (the loader refuses to resume on different data)."""
        if self._fingerprint is None:
            digest = hashlib.blake2b(digest_size=16)
            for part in (self._offsets, self._token_ids, self._loss_mask):
                digest.update(part.dtype.str.encode())
                digest.update(part.data)
            self._fingerprint = digest.hexdigest()
        return self._fingerprint

    def check_token_cap(self, cap: int, *, sp_size: int = 1, key: str = "data.max_token_len_per_gpu") -> None:
        """Raise SequenceTooLongError naming file and row of the first sample longer than ``cap * sp_size``
        (the balancer's ``overlong='error'`` rule, at load time); ``key`` names ``cap``'s config key."""
        if cap < 1 or sp_size < 1:
            raise DataError(f"{key}={cap} and sp_size={sp_size} must be >= 1")
        limit = cap * sp_size
        lengths = self.seq_lens
        over = np.flatnonzero(lengths > limit)
        if not len(over):
            return
        first = int(over[0])
        path, row = self.origin(first)
        raise SequenceTooLongError(
            f"{path}: row {row}: {int(lengths[first])} tokens > {key}={cap} * sp_size={sp_size} = {limit} "
            f"({len(over)} sample(s) over it, longest {int(lengths[over].max())} tokens); raise {key}, lower "
            f"max_length={self.config.max_length} with truncation='left'/'right', or set balance.overlong to "
            "'skip'/'truncate'"
        )

    def collate(self, samples: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """``collate_sft`` with this dataset's tokenizer's pad id."""
        return collate_sft(samples, pad_token_id=self.tokenizer.pad_token_id)


def collate_sft(samples: Sequence[Mapping[str, torch.Tensor]], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad samples to (B, L): input_ids, attention_mask, loss_mask, position_ids (all int64)."""
    if not samples:
        raise DataError("cannot collate an empty list of samples")
    lengths = [len(s[INPUT_IDS_KEY]) for s in samples]
    batch_size, max_len = len(samples), max(lengths)
    input_ids = torch.full((batch_size, max_len), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch_size, max_len), dtype=torch.long)
    loss_mask = torch.zeros((batch_size, max_len), dtype=torch.long)
    position_ids = torch.zeros((batch_size, max_len), dtype=torch.long)
    for i, (sample, length) in enumerate(zip(samples, lengths)):
        input_ids[i, :length] = sample[INPUT_IDS_KEY]
        loss_mask[i, :length] = sample[LOSS_MASK_KEY]
        attention_mask[i, :length] = 1
        position_ids[i, :length] = torch.arange(length)
    return {
        INPUT_IDS_KEY: input_ids,
        ATTENTION_MASK_KEY: attention_mask,
        LOSS_MASK_KEY: loss_mask,
        POSITION_IDS_KEY: position_ids,
    }
