"""SFT dataset: token-aligned loss masks (hand-worked), truncation, malformed rows, collation."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verl_balance.data import (
    ByteTokenizer,
    DataError,
    MalformedRowError,
    SequenceTooLongError,
    SFTDataConfig,
    SFTDataset,
    collate_sft,
)

BOS, SEP, EOS, PAD = ByteTokenizer.BOS, ByteTokenizer.SEP, ByteTokenizer.EOS, ByteTokenizer.PAD
a, b, c = ord("a"), ord("b"), ord("c")


def _jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def _dataset(path, **config):
    return SFTDataset(files=path, tokenizer=ByteTokenizer(), config=SFTDataConfig(**config))


def test_prompt_response_mask_marks_exactly_the_response_and_eos(tmp_path):
    ds = _dataset(_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "response": "c"}]))
    assert ds[0]["input_ids"].tolist() == [BOS, a, b, SEP, c, EOS]
    assert ds[0]["loss_mask"].tolist() == [0, 0, 0, 0, 1, 1]


def test_multi_turn_mask_marks_every_assistant_turn(tmp_path):
    messages = [
        {"role": "system", "content": "a"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "bc"},
    ]
    ds = _dataset(_jsonl(tmp_path / "d.jsonl", [{"messages": messages}]), messages_key="messages")
    assert ds[0]["input_ids"].tolist() == [BOS, a, ord("\n"), b, SEP, c, EOS, a, SEP, b, c, EOS]
    assert ds[0]["loss_mask"].tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1]


def test_parquet_prompt_response_and_messages_give_identical_samples(tmp_path):
    rows = {"prompt": ["ab", "b"], "response": ["c", "abc"]}
    rows["messages"] = [
        [{"role": "user", "content": p}, {"role": "assistant", "content": r}]
        for p, r in zip(rows["prompt"], rows["response"])
    ]
    path, plain_path = str(tmp_path / "d.parquet"), str(tmp_path / "plain.parquet")
    pq.write_table(pa.table(rows), path)
    pq.write_table(pa.table({k: rows[k] for k in ("prompt", "response")}), plain_path)
    plain, chat = _dataset(plain_path), _dataset(path, messages_key="messages")
    assert plain.chat_columns == [None] and chat.chat_columns == ["messages"]
    for i in range(2):
        assert plain[i]["input_ids"].tolist() == chat[i]["input_ids"].tolist()
        assert plain[i]["loss_mask"].tolist() == chat[i]["loss_mask"].tolist()
    assert plain.seq_lens.tolist() == [6, 7] and plain.num_loss_tokens.tolist() == [2, 4]


@pytest.mark.parametrize(
    "truncation, ids, mask",
    [
        # left keeps the newest tokens; position 0 is never a target, so its mask is cleared
        ("left", [c, EOS], [0, 1]),
        ("right", [BOS, a], [0, 0]),
    ],
)
def test_truncation_modes_keep_the_documented_end(tmp_path, truncation, ids, mask):
    ds = _dataset(
        _jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "response": "c"}]), max_length=2, truncation=truncation
    )
    assert ds[0]["input_ids"].tolist() == ids and ds[0]["loss_mask"].tolist() == mask
    assert ds.num_truncated == 1
    assert ds.num_without_targets == (0 if truncation == "left" else 1)


def test_truncation_error_names_file_row_and_fix(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b"}, {"prompt": "ab", "response": "cab"}])
    with pytest.raises(SequenceTooLongError, match=r"d\.jsonl: row 1: 8 tokens > max_length=6.*left"):
        _dataset(path, max_length=6)


MALFORMED_ROWS = [
    ({"prompt": "a"}, "missing or null key 'response'"),
    ({"prompt": "a", "response": 3}, "'response' must be a string"),
    ({"prompt": "a", "response": ""}, "empty string"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected an object"),
]


@pytest.mark.parametrize("bad_row, reason", MALFORMED_ROWS)
def test_malformed_row_error_names_file_and_row(tmp_path, bad_row, reason):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "response": "b"}, bad_row])
    with pytest.raises(MalformedRowError, match=r"bad\.jsonl: row 1: ") as info:
        _dataset(path)
    assert reason in str(info.value) and info.value.row == 1 and info.value.path == path


def test_skip_policy_counts_every_malformed_row_and_keeps_the_rest(tmp_path):
    rows = [{"prompt": "a", "response": "b"}] + [r for r, _ in MALFORMED_ROWS] + [{"prompt": "c", "response": "a"}]
    ds = _dataset(_jsonl(tmp_path / "d.jsonl", rows), on_malformed="skip")
    assert len(ds) == 2 and len(ds.skipped) == len(MALFORMED_ROWS)
    assert [e.row for e in ds.skipped] == list(range(1, 1 + len(MALFORMED_ROWS)))
    assert ds.origin(1)[1] == len(rows) - 1


def test_malformed_messages_and_parquet_nulls_are_named(tmp_path):
    path = str(tmp_path / "m.parquet")
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "a"}], None]}), path)
    with pytest.raises(MalformedRowError, match=r"m\.parquet: row 0: .*no assistant message"):
        _dataset(path, messages_key="messages")
    with pytest.raises(DataError, match="no usable rows"):
        _dataset(path, messages_key="messages", on_malformed="skip")


def test_missing_column_and_bad_files_are_named(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"question": ["a"], "answer": ["b"]}), path)
    with pytest.raises(DataError, match=r"missing column\(s\) \['prompt', 'response'\].*question"):
        _dataset(path)
    with pytest.raises(DataError, match="unsupported file type"):
        _dataset(str(tmp_path / "d.csv"))
    with pytest.raises(DataError, match="not found"):
        _dataset(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="truncation='middle'"):
        SFTDataConfig(truncation="middle")


def test_collate_right_pads_with_contiguous_attention_and_restarting_positions():
    samples = [
        {"input_ids": torch.tensor([BOS, a, SEP, b, EOS]), "loss_mask": torch.tensor([0, 0, 0, 1, 1])},
        {"input_ids": torch.tensor([BOS, SEP, c]), "loss_mask": torch.tensor([0, 0, 1])},
    ]
    batch = collate_sft(samples, pad_token_id=PAD)
    assert batch["input_ids"].tolist() == [[BOS, a, SEP, b, EOS], [BOS, SEP, c, PAD, PAD]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


# verl's rule for data.messages_key, with prompt/response files kept: rows whose chat differs from
# their prompt/response pair show which columns were read.
CHAT = [{"role": "user", "content": "b"}, {"role": "assistant", "content": "ab"}]
CHAT_IDS = [BOS, b, SEP, a, b, EOS]
PAIR_IDS = [BOS, a, SEP, c, EOS]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_unset_messages_key_reads_verls_default_messages_column_when_the_file_has_one(tmp_path, suffix):
    rows = [{"messages": CHAT, "prompt": "a", "response": "c"}]
    both, pair = _file(tmp_path / f"both.{suffix}", rows), _file(tmp_path / f"pair.{suffix}", rows, drop="messages")
    assert _dataset(both)[0]["input_ids"].tolist() == CHAT_IDS
    assert _dataset(pair)[0]["input_ids"].tolist() == PAIR_IDS
    # Negative control: an explicit key is read even where prompt/response are present.
    renamed = _file(tmp_path / f"chat.{suffix}", [{"chat": CHAT, "prompt": "a", "response": "c"}])
    assert _dataset(renamed)[0]["input_ids"].tolist() == PAIR_IDS
    assert _dataset(renamed, messages_key="chat")[0]["input_ids"].tolist() == CHAT_IDS


def test_unset_messages_key_chooses_per_file_and_reports_the_choice(tmp_path):
    rows = [{"messages": CHAT, "prompt": "a", "response": "c"}]
    files = [_file(tmp_path / "both.parquet", rows), _file(tmp_path / "pair.jsonl", rows, drop="messages")]
    ds = SFTDataset(files=files, tokenizer=ByteTokenizer())
    assert ds.chat_columns == ["messages", None]
    assert [ds[i]["input_ids"].tolist() for i in range(2)] == [CHAT_IDS, PAIR_IDS]


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_set_messages_key_missing_from_the_file_is_refused_naming_key_columns_and_fix(tmp_path, suffix):
    path = _file(tmp_path / f"pair.{suffix}", [{"prompt": "a", "response": "c"}])
    with pytest.raises(DataError) as info:
        _dataset(path, messages_key="messages")
    message = str(info.value)
    assert f"pair.{suffix}: data.messages_key='messages' is not a column" in message
    assert "columns present: ['prompt', 'response']" in message and "remove it" in message


@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_file_with_neither_chats_nor_prompt_response_is_refused_naming_both(tmp_path, suffix):
    path = _file(tmp_path / f"qa.{suffix}", [{"question": "a", "response": "c"}])
    with pytest.raises(DataError) as info:
        _dataset(path)
    message = str(info.value)
    assert "missing column(s) ['prompt'] (data.prompt_key/data.response_key)" in message
    assert "no 'messages' column (data.messages_key" in message and "['question', 'response']" in message
    # The fix the message names works.
    assert _dataset(path, prompt_key="question")[0]["input_ids"].tolist() == PAIR_IDS


def test_jsonl_columns_come_from_the_first_object_rows_past_malformed_lines(tmp_path):
    rows = ["{not json", {"prompt": "a"}, {"prompt": "a", "response": "c"}]
    ds = _dataset(_jsonl(tmp_path / "d.jsonl", rows), on_malformed="skip")
    assert ds.chat_columns == [None] and len(ds) == 1 and len(ds.skipped) == 2


def _file(path, rows, *, drop: str | None = None) -> str:
    rows = [{k: v for k, v in row.items() if k != drop} for row in rows]
    if str(path).endswith(".jsonl"):
        return _jsonl(path, rows)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)
