"""A parquet file that is empty or not parquet fails naming the file (not Arrow's bare ArrowInvalid)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_balance.data import ByteTokenizer, RLDataConfig, RLPromptDataset, SFTDataConfig, SFTDataset
from verl_balance.data.io import DataError


@pytest.mark.parametrize("content", [b"", b"PAR1 this is not parquet", b"PAR1"])
def test_empty_or_corrupt_parquet_names_the_file(tmp_path, content):
    path = tmp_path / "train.parquet"
    path.write_bytes(content)
    with pytest.raises(DataError, match=rf"{path}: not a readable parquet file \({len(content)} bytes\)"):
        SFTDataset(files=str(path), tokenizer=ByteTokenizer(), config=SFTDataConfig())
    with pytest.raises(DataError, match=rf"{path}: not a readable parquet file"):
        RLPromptDataset(files=str(path), tokenizer=ByteTokenizer(), config=RLDataConfig())


def test_truncated_parquet_names_the_file(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["a"] * 100, "response": ["b"] * 100}), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=rf"{path}: "):
        SFTDataset(files=str(path), tokenizer=ByteTokenizer(), config=SFTDataConfig())


def test_intact_parquet_loads(tmp_path):
    """Negative control: the same reader loads a well-formed file."""
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "response": ["c", "d"]}), path)
    assert len(SFTDataset(files=str(path), tokenizer=ByteTokenizer(), config=SFTDataConfig())) == 2
