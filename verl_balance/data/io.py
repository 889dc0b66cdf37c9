"""Row readers for parquet and jsonl files, and the errors that name a file and row.

Rows are numbered from 0 in file order, for parquet and jsonl alike (jsonl row i is line i + 1;
blank lines are not rows). Every error about data names the file and the row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

SUPPORTED_SUFFIXES = (".parquet", ".jsonl")
MALFORMED_POLICIES = ("error", "skip")
TRUNCATION_MODES = ("error", "left", "right")


class DataError(ValueError):
    """A data file that cannot be read as configured."""


class MalformedRowError(DataError):
    """A row that is missing a key, has the wrong type, or an empty target."""

    def __init__(self, path: str, row: int, reason: str, *, hint: str = ""):
        self.path, self.row, self.reason = path, row, reason
        super().__init__(f"{path}: row {row}: {reason}" + (f" ({hint})" if hint else ""))


class SequenceTooLongError(DataError):
    """A sample longer than the configured maximum under truncation='error'."""


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


def iter_rows(
    path: str, *, columns: Sequence[str], optional_columns: Sequence[str] = ()
) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Yield (row index, row) for a parquet or jsonl file, keeping only the named columns.

    A row is a dict of the available requested columns; a jsonl line that is not a JSON object is
    yielded as the error string (so the caller's malformed-row policy applies to it). A parquet
    file missing a column is a whole-file error naming the column and the columns present.
    """
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        schema_names = pq.read_schema(path).names
        missing = [c for c in columns if c not in schema_names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; columns present: {schema_names}")
        present_optional = [c for c in optional_columns if c in schema_names]
        table = pq.read_table(path, columns=[*columns, *present_optional])
        yield from enumerate(table.to_pylist())
        return
    with open(path, encoding="utf-8") as f:
        row = 0
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                yield row, f"line {line_number} is not valid JSON ({err.msg})"
            else:
                if isinstance(record, dict):
                    yield row, {c: record[c] for c in (*columns, *optional_columns) if c in record}
                else:
                    yield row, f"line {line_number} is a JSON {type(record).__name__}, expected an object"
            row += 1


def check_choice(name: str, value: str, valid: Sequence[str]) -> None:
    """Raise DataError naming the key when ``value`` is not one of ``valid``."""
    if value not in valid:
        raise DataError(f"{name}={value!r} is invalid; valid values: {', '.join(valid)}")
