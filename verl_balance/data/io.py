"""Row readers for parquet and jsonl files, and the errors that name a file and row.

Rows are numbered from 0 in file order (jsonl row i is line i + 1; blank lines are not rows).
Readers stream (one record batch or line at a time). Text that is not valid Unicode makes its row
malformed, so the caller's malformed-row policy applies to it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

SUPPORTED_SUFFIXES = (".parquet", ".jsonl")
MALFORMED_POLICIES = ("error", "skip")
TRUNCATION_MODES = ("error", "left", "right")
PARQUET_BATCH_ROWS = 1024

# A JSON \u escape of a UTF-16 surrogate (pairs are legal; json.loads joins them, lone ones survive).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class DataError(ValueError):
    """A data file that cannot be read as configured."""


class MalformedRowError(DataError):
    """A row that is missing a key, has the wrong type, an empty target or text that is not valid Unicode."""

    def __init__(self, path: str, row: int, reason: str, *, hint: str = ""):
        self.path, self.row, self.reason = path, row, reason
        super().__init__(f"{path}: row {row}: {reason}" + (f" ({hint})" if hint else ""))


class SequenceTooLongError(DataError):
    """A sample longer than the configured maximum (or a token cap) under a policy that forbids it."""


def as_file_list(files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """One path or a sequence of paths (lists, tuples, OmegaConf ListConfig) as a list of str."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths = [os.path.expanduser(os.fspath(f)) for f in files]
    if not paths:
        raise DataError("no data files given; set the files key to a parquet or jsonl path (or a list of them)")
    for path in paths:
        if not path.endswith(SUPPORTED_SUFFIXES):
            raise DataError(f"{path}: unsupported file type; valid suffixes: {', '.join(SUPPORTED_SUFFIXES)}")
        if not os.path.isfile(path):
            raise DataError(f"{path}: file not found")
    return paths


def find_invalid_text(value: Any, *, where: str = "") -> str | None:
    """Where a nested row value holds a string that cannot be encoded as UTF-8 (a lone surrogate), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            bad = value[err.start : err.end].encode("unicode_escape").decode("ascii")
            return f"{where or 'a value'} holds a lone surrogate '{bad}' at character {err.start} (not valid Unicode)"
        return None
    if isinstance(value, Mapping):
        for key, item in value.items():
            inner = f"key {key!r}" if not where else f"{where}[{key!r}]"
            found = find_invalid_text(item, where=inner)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = find_invalid_text(item, where=f"{where or 'a list'}[{i}]")
            if found:
                return found
    return None


def iter_rows(
    path: str, *, columns: Sequence[str], optional_columns: Sequence[str] = ()
) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Yield (row index, row) for a parquet or jsonl file, keeping only the named columns.

    A row that cannot be read is yielded as the error string; a parquet file missing a column is a
    whole-file DataError naming the columns present.
    """
    if path.endswith(".parquet"):
        yield from _iter_parquet(path, columns=columns, optional_columns=optional_columns)
    else:
        yield from _iter_jsonl(path, keys=(*columns, *optional_columns))


def _iter_parquet(path: str, *, columns: Sequence[str], optional_columns: Sequence[str]):
    import pyarrow as pa

    parquet_file = open_parquet(path)
    schema_names = parquet_file.schema_arrow.names
    missing = [c for c in columns if c not in schema_names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; columns present: {schema_names}")
    names = [*columns, *(c for c in optional_columns if c in schema_names)]
    row = 0
    for batch in _parquet_batches(parquet_file, path=path, columns=names):
        try:
            values = [batch.column(name).to_pylist() for name in names]
        except UnicodeDecodeError:
            yield from _parquet_rows_one_by_one(batch, names, first_row=row)
        else:
            for offset, row_values in enumerate(zip(*values)):
                yield row + offset, dict(zip(names, row_values))
        row += batch.num_rows
    del parquet_file
    pa.default_memory_pool().release_unused()  # Arrow's allocator keeps freed pages otherwise


def open_parquet(path: str):
    """``pyarrow.parquet.ParquetFile`` of ``path``; a non-parquet file raises DataError naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        size = os.path.getsize(path) if os.path.exists(path) else None
        raise DataError(f"{path}: not a readable parquet file ({size} bytes): {err}") from err


def _parquet_batches(parquet_file, *, path: str, columns: Sequence[str]):
    """Record batches of ``parquet_file``; a corrupt page raises DataError naming ``path``."""
    import pyarrow as pa

    batches = parquet_file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{path}: the parquet data cannot be read (corrupt file?): {err}") from err
        yield batch


def _parquet_rows_one_by_one(batch, names: Sequence[str], *, first_row: int):
    """Rows of a record batch that holds invalid UTF-8 somewhere; the bad rows become error strings."""
    for offset in range(batch.num_rows):
        record, reason = {}, None
        for name in names:
            try:
                record[name] = batch.column(name)[offset].as_py()
            except UnicodeDecodeError as err:
                reason = f"column {name!r} is not valid UTF-8 ({err.reason} at byte {err.start})"
                break
        yield first_row + offset, (record if reason is None else reason)


def _iter_jsonl(path: str, *, keys: Sequence[str]):
    with open(path, "rb") as f:
        row = 0
        for line_number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            yield row, _parse_jsonl_line(raw, line_number=line_number, keys=keys)
            row += 1


def _parse_jsonl_line(raw: bytes, *, line_number: int, keys: Sequence[str]) -> dict[str, Any] | str:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return (
            f"line {line_number} is not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte offset {err.start}: "
            f"{err.reason})"
        )
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        return f"line {line_number} is not valid JSON ({err.msg})"
    if not isinstance(record, dict):
        return f"line {line_number} is a JSON {type(record).__name__}, expected an object"
    record = {c: record[c] for c in keys if c in record}
    if _SURROGATE_ESCAPE.search(raw):
        found = find_invalid_text(record)
        if found:
            return f"line {line_number}: {found}"
    return record


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause automatic cyclic garbage collection while building a dataset (it rescans the many live
    objects); builders call ``collect_young_garbage()`` after each chunk."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def collect_young_garbage() -> None:
    """Collect reference cycles among recently created objects (generations 0 and 1 only)."""
    gc.collect(1)


def num_rows_hint(path: str) -> int | None:
    """Rows of a parquet file from its footer (cheap), or None for jsonl (not known before reading it)."""
    if not path.endswith(".parquet"):
        return None
    return open_parquet(path).metadata.num_rows


def file_columns(path: str, *, sample_rows: int = PARQUET_BATCH_ROWS) -> list[str]:
    """The columns of a data file: a parquet file's schema, or the keys of a jsonl file's first
    ``sample_rows`` JSON-object lines, in first-seen order."""
    if path.endswith(".parquet"):
        return list(open_parquet(path).schema_arrow.names)
    keys: dict[str, None] = {}
    seen = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            if isinstance(record, dict):
                keys.update(dict.fromkeys(record))
                seen += 1
                if seen == sample_rows:
                    break
    return list(keys)


def check_choice(name: str, value: str, valid: Sequence[str]) -> None:
    """Raise DataError naming the key when ``value`` is not one of ``valid``."""
    if value not in valid:
        raise DataError(f"{name}={value!r} is invalid; valid values: {', '.join(valid)}")
