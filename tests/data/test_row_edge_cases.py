"""Rows that are not valid Unicode, and the load-time token-cap check: errors name file and row; skip skips."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_balance.data import (
    ByteTokenizer,
    MalformedRowError,
    RLDataConfig,
    RLPromptDataset,
    SequenceTooLongError,
    SFTDataConfig,
    SFTDataset,
)


def _write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n")
    return str(path)


def _sft(path, **config):
    return SFTDataset(files=path, tokenizer=ByteTokenizer(), config=SFTDataConfig(**config))


GOOD = {"prompt": "a", "response": "b"}
NON_UTF8 = b'{"prompt": "a\xff", "response": "b"}'
LONE_SURROGATE = b'{"prompt": "a", "response": "b\\ud800c"}'


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        (NON_UTF8, r"line 2 is not valid UTF-8 \(byte 0xff"),
        (LONE_SURROGATE, r"line 2: key 'response' holds a lone surrogate '\\ud800' at character 1"),
    ],
)
def test_invalid_unicode_in_jsonl_names_file_and_row(tmp_path, bad_line, reason):
    path = _write_lines(tmp_path / "u.jsonl", [GOOD, bad_line, GOOD])
    with pytest.raises(MalformedRowError, match=r"u\.jsonl: row 1: " + reason) as info:
        _sft(path)
    assert info.value.path == path and info.value.row == 1


def test_skip_drops_invalid_unicode_rows_and_keeps_the_rest(tmp_path):
    path = _write_lines(tmp_path / "u.jsonl", [GOOD, NON_UTF8, {"prompt": "c", "response": "a"}, LONE_SURROGATE])
    ds = _sft(path, on_malformed="skip")
    assert len(ds) == 2 and [e.row for e in ds.skipped] == [1, 3]
    assert [ds.origin(i)[1] for i in range(2)] == [0, 2]
    assert ds[1]["input_ids"].tolist() == [ByteTokenizer.BOS, ord("c"), ByteTokenizer.SEP, ord("a"), ByteTokenizer.EOS]


def test_escaped_surrogate_pair_is_valid_text(tmp_path):
    # negative control for the lone-surrogate check: a pair is one character (U+1F600)
    path = _write_lines(tmp_path / "u.jsonl", [b'{"prompt": "\\ud83d\\ude00", "response": "b"}'])
    ds = _sft(path)
    assert ds[0]["input_ids"].tolist()[1:5] == list("\U0001f600".encode())


def test_lone_surrogate_inside_a_chat_names_the_message(tmp_path):
    chat = b'{"messages": [{"role": "user", "content": "x\\udc00"}, {"role": "assistant", "content": "y"}]}'
    path = _write_lines(tmp_path / "c.jsonl", [chat])
    expected = r"c\.jsonl: row 0: line 1: key 'messages'\[0\]\['content'\] holds a lone surrogate"
    with pytest.raises(MalformedRowError, match=expected):
        _sft(path, messages_key="messages")


def _parquet_with_invalid_utf8(path, *, bad_row, num_rows=3):
    """A string column whose row ``bad_row`` holds the byte 0xff (writers other than pyarrow can produce it)."""
    values = [b"ab"] * num_rows
    values[bad_row] = b"a\xff"
    offsets, data = [0], b""
    for value in values:
        data += value
        offsets.append(len(data))
    prompts = pa.Array.from_buffers(
        pa.string(), num_rows, [None, pa.array(offsets, pa.int32()).buffers()[1], pa.py_buffer(data)]
    )
    pq.write_table(pa.table({"prompt": prompts, "response": pa.array(["c"] * num_rows)}), str(path))
    return str(path)


def test_invalid_utf8_in_parquet_names_file_and_row_and_skip_skips_it(tmp_path):
    path = _parquet_with_invalid_utf8(tmp_path / "u.parquet", bad_row=1)
    with pytest.raises(MalformedRowError, match=r"u\.parquet: row 1: column 'prompt' is not valid UTF-8"):
        _sft(path)
    ds = _sft(path, on_malformed="skip")
    assert len(ds) == 2 and [e.row for e in ds.skipped] == [1] and ds.origin(1)[1] == 2


def test_rl_prompts_with_invalid_unicode_name_file_and_row_or_are_skipped(tmp_path):
    def row(content):
        return {
            "data_source": "s",
            "prompt": [{"role": "user", "content": content}],
            "reward_model": {"ground_truth": "x"},
        }

    lines = [row("a"), json.dumps(row("b")).replace("b", "\\ud800").encode(), NON_UTF8, row("c")]
    path = _write_lines(tmp_path / "p.jsonl", lines)
    with pytest.raises(MalformedRowError, match=r"p\.jsonl: row 1: .*lone surrogate"):
        RLPromptDataset(files=path, tokenizer=ByteTokenizer())
    ds = RLPromptDataset(files=path, tokenizer=ByteTokenizer(), config=RLDataConfig(on_malformed="skip"))
    assert len(ds) == 2 and [e.row for e in ds.skipped] == [1, 2] and ds[1].raw_prompt[0]["content"] == "c"


def test_token_cap_check_names_file_and_row_of_the_first_overlong_sample(tmp_path):
    # byte tokenizer: length = len(prompt) + len(response) + 3 specials
    first = _write_lines(tmp_path / "a.jsonl", [{"prompt": "a", "response": "b"}])  # 5 tokens
    second = _write_lines(
        tmp_path / "b.jsonl",
        [
            {"prompt": "a"},  # malformed, skipped: sample indices and rows differ from here on
            {"prompt": "abc", "response": "d"},  # 7 tokens
            {"prompt": "abcdef", "response": "g"},  # 10 tokens
            {"prompt": "abcdefgh", "response": "i"},  # 12 tokens
        ],
    )
    ds = _sft([first, second], on_malformed="skip")
    assert ds.seq_lens.tolist() == [5, 7, 10, 12]
    ds.check_token_cap(12)  # fits exactly: negative control
    ds.check_token_cap(6, sp_size=2)
    with pytest.raises(
        SequenceTooLongError,
        match=r"b\.jsonl: row 2: 10 tokens > data\.max_token_len_per_gpu=9 "
        r"\* sp_size=1 = 9 \(2 sample\(s\) over it, longest 12 tokens\)",
    ):
        ds.check_token_cap(9)
    with pytest.raises(SequenceTooLongError, match=r"b\.jsonl: row 1: 7 tokens > my\.cap=3 \* sp_size=2 = 6"):
        ds.check_token_cap(3, sp_size=2, key="my.cap")
