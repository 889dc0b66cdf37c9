"""SFT on verl's multi-turn tool format: assistant ``tool_calls`` and ``tool`` messages, a ``tools`` column.

References: the loss mask against the assistant spans found by hand in the chat template's one-shot
rendering (string search for the assistant openers and end-of-turn tokens), and against verl's own
``MultiTurnSFTDataset`` on the same parquet row. Negative control: a mask that also counts the tool
output's tokens (what a mask ending at the first assistant opener would train on) differs.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.data import DataError, MalformedRowError, SFTDataConfig, SFTDataset
from verl_balance.data.tokenizer import ByteTokenizer, HFTokenizer
from verl_balance.models import tiny_hf

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 3 * 4 + 5"}},
            "required": ["expression"],
        },
    },
}
TOOL_OUTPUT = "17"


def _call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


MESSAGES = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": "What is 3 * 4 + 5?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("3 * 4 + 5")]},
    {"role": "tool", "content": TOOL_OUTPUT},
    {"role": "assistant", "content": "#### 17"},
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tiny_hf.build_tokenizer(chat_template=tiny_hf.TOOL_CHAT_TEMPLATE).save_pretrained(path)
    return str(path)


def _parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _dataset(path, tok_dir, **config) -> SFTDataset:
    return SFTDataset(files=path, tokenizer=HFTokenizer(tok_dir), config=SFTDataConfig(**config))


def _hand_reference(tok_dir) -> tuple[list[int], list[int]]:
    """Ids and mask from the one-shot rendering cut by hand: each assistant turn's target runs from after
    its ``<|im_start|>assistant\\n`` through its ``<|im_end|>\\n``; every other piece is context."""
    hf = HFTokenizer(tok_dir).hf_tokenizer
    text = hf.apply_chat_template(MESSAGES, tools=[SCHEMA], tokenize=False)
    opener, closer = "<|im_start|>assistant\n", "<|im_end|>\n"
    pieces, position = [], 0
    while (start := text.find(opener, position)) >= 0:
        start += len(opener)
        end = text.index(closer, start) + len(closer)
        pieces += [(text[position:start], 0), (text[start:end], 1)]
        position = end
    pieces.append((text[position:], 0))
    ids, mask = [], []
    for piece, target in pieces:
        piece_ids = hf.encode(piece, add_special_tokens=False)
        ids += piece_ids
        mask += [target] * len(piece_ids)
    return ids, mask


def test_tool_chat_mask_is_exactly_the_assistant_turns_found_by_hand(tmp_path, tok_dir):
    ds = _dataset(_parquet(tmp_path / "d.parquet", [{"messages": MESSAGES, "tools": [SCHEMA]}]), tok_dir)
    ids, mask = ds[0]["input_ids"].tolist(), ds[0]["loss_mask"].tolist()
    ref_ids, ref_mask = _hand_reference(tok_dir)
    assert ids == ref_ids and mask == ref_mask
    hf = HFTokenizer(tok_dir).hf_tokenizer
    trained = hf.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert '"arguments": {"expression": "3 * 4 + 5"}' in trained, "the tool call is a target"
    assert "<tools>" in hf.decode(ids, skip_special_tokens=False), "the tools column reached the template"
    assert "<tool_response>" not in trained and TOOL_OUTPUT + "\n</tool_response>" not in trained
    # Negative control: a mask from the first assistant opener to the end also trains on the tool output.
    first = mask.index(1)
    counting_tool_tokens = [0] * first + [1] * (len(mask) - first)
    assert counting_tool_tokens != mask
    assert sum(counting_tool_tokens) > sum(mask) + len(hf.encode(TOOL_OUTPUT, add_special_tokens=False))


def test_tool_chat_sample_equals_verls_multiturn_sft_dataset(tmp_path, tok_dir):
    multiturn = pytest.importorskip("verl.utils.dataset.multiturn_sft_dataset", reason=VERL_SKIP_REASON)
    path = _parquet(tmp_path / "d.parquet", [{"messages": MESSAGES, "tools": [SCHEMA]}])
    ours = _dataset(path, tok_dir)[0]
    tokenizer = HFTokenizer(tok_dir).hf_tokenizer
    theirs = multiturn.MultiTurnSFTDataset(path, tokenizer, {"pad_mode": "no_padding", "max_length": 4096})[0]
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["loss_mask"], theirs["loss_mask"].long())
    # Negative control: verl's mask without the tools column is another sample (no tools block).
    plain = _parquet(tmp_path / "plain.parquet", [{"messages": MESSAGES}])
    assert len(_dataset(plain, tok_dir)[0]["input_ids"]) < len(ours["input_ids"])


BAD_ROWS = [
    ({"role": "assistant", "content": "x", "tool_calls": "calculator(1)"}, "'tool_calls' must be a list"),
    ({"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "calculator"}}]}, "'arguments'"),
    ({"role": "robot", "content": "x"}, "valid roles"),
]


@pytest.mark.parametrize("bad, reason", BAD_ROWS)
def test_bad_tool_message_is_one_error_naming_the_row(tmp_path, tok_dir, bad, reason):
    rows = [{"messages": MESSAGES}, {"messages": [*MESSAGES[:2], bad, {"role": "assistant", "content": "y"}]}]
    with pytest.raises(MalformedRowError, match=r"d\.jsonl: row 1: ") as info:
        _dataset(_jsonl(tmp_path / "d.jsonl", rows), tok_dir)
    assert reason in str(info.value)


def test_tool_message_without_a_preceding_call_is_named(tmp_path, tok_dir):
    orphan = [MESSAGES[1], {"role": "tool", "content": "17"}, {"role": "assistant", "content": "#### 17"}]
    with pytest.raises(MalformedRowError, match=r"row 0: .*'tool' message without a preceding call"):
        _dataset(_jsonl(tmp_path / "d.jsonl", [{"messages": orphan}]), tok_dir)


def test_tools_column_that_is_not_a_list_of_schemas_is_named(tmp_path, tok_dir):
    rows = [{"messages": MESSAGES, "tools": [SCHEMA]}, {"messages": MESSAGES, "tools": "calculator"}]
    with pytest.raises(MalformedRowError, match=r"row 1: column 'tools' \(data.tools_key\)"):
        _dataset(_jsonl(tmp_path / "d.jsonl", rows), tok_dir)


def test_byte_tokenizer_refuses_tool_chats_naming_the_row_and_fix(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"messages": MESSAGES}])
    with pytest.raises(DataError, match=r"row 0: the byte tokenizer cannot render .*--tool-chat-template"):
        SFTDataset(files=path, tokenizer=ByteTokenizer(), config=SFTDataConfig())


def _jsonl(path, rows) -> str:
    import json

    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)
