"""``data/tool_tasks.py``: the synthetic tool task's RL rows, tool config and SFT demonstrations.

References: the arithmetic of each question recomputed from its text (regex, Python ints); the loss
mask of a demonstration against the assistant turns' text; the tool's answer from the tool config
file, loaded the way the rollout loads it.
"""

from __future__ import annotations

import asyncio
import re

import pyarrow.parquet as pq
import pytest

from verl_balance.data import SFTDataConfig, SFTDataset
from verl_balance.data.tokenizer import HFTokenizer
from verl_balance.data.tool_tasks import make_sft_rows, write_dataset
from verl_balance.models import tiny_hf
from verl_balance.tools import load_tools
from verl_balance.tools.calculator import CalculatorTool, evaluate


def _value(question: str) -> int:
    a, b, c = (int(v) for v in re.fullmatch(r"What is (\d+) \* (\d+) \+ (\d+)\?", question).groups())
    return a * b + c


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    tiny_hf.build_tokenizer(chat_template=tiny_hf.TOOL_CHAT_TEMPLATE).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("tool", ["gsm8k", "calculator"])
def test_demonstrations_call_the_tool_answer_with_its_output_and_load_as_tool_chats(tmp_path, tok_dir, tool):
    paths = write_dataset(str(tmp_path), num_train=6, num_val=2, tool=tool, max_operand=9)
    rl, sft = pq.read_table(paths["train"]).to_pylist(), pq.read_table(paths["sft_train"]).to_pylist()
    assert [r["extra_info"]["question"] for r in rl] == [row["messages"][1]["content"] for row in sft]
    for rl_row, row in zip(rl, sft):
        value = _value(row["messages"][1]["content"])
        assert rl_row["reward_model"]["ground_truth"] == str(value)
        call, answer, final = row["messages"][2:]
        name = call["tool_calls"][0]["function"]["name"]
        assert name == row["tools"][0]["function"]["name"] and answer["role"] == "tool"
        assert final == {"role": "assistant", "content": f"#### {value}", "tool_calls": None}
        if tool == "calculator":
            assert answer["content"] == str(value)
        else:
            assert answer["content"] == f"Current parsed answer='{value}' reward=1.0"
    dataset = SFTDataset(
        files=paths["sft_train"], tokenizer=HFTokenizer(tok_dir), config=SFTDataConfig(max_length=2048)
    )
    hf = HFTokenizer(tok_dir).hf_tokenizer
    ids, mask = dataset[0]["input_ids"].tolist(), dataset[0]["loss_mask"].tolist()
    trained = hf.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
    value = _value(sft[0]["messages"][1]["content"])
    assert trained.startswith("<tool_call>\n") and trained.endswith(f"#### {value}<|im_end|>\n")
    assert "<tool_response>" not in trained and sum(mask) < len(mask) // 2  # context: tools block, question, tool


def test_direct_fraction_spreads_answers_without_the_tool():
    rows = make_sft_rows(count=8, split="train", seed=0, tool="calculator", direct_fraction=0.5)
    with_tool = [len(row["messages"]) == 5 for row in rows]
    assert with_tool == [True, False] * 4
    assert all(row["messages"][-1]["content"] == f"#### {_value(row['messages'][1]['content'])}" for row in rows)
    assert all(len(row["messages"]) == 3 for row in make_sft_rows(count=4, split="val", seed=0, direct_fraction=1.0))
    with pytest.raises(ValueError, match="direct_fraction=1.5"):
        make_sft_rows(count=1, split="train", seed=0, direct_fraction=1.5)


def test_calculator_config_loads_and_its_tool_answers_the_value(tmp_path):
    paths = write_dataset(str(tmp_path), num_train=1, num_val=1, tool="calculator")
    tools = load_tools(tool_config_path=paths["tool_config"], function_tool_path=None)
    assert isinstance(tools["calculator"], CalculatorTool)
    response, reward, _ = asyncio.run(tools["calculator"].execute("id", {"expression": "13 * 4 + 5"}))
    assert (response.text, reward) == ("57", 0.0)


@pytest.mark.parametrize(
    "expression, value",
    [("3 * 4 + 5", 17), ("-(2 + 3) * 4", -20), ("7 / 2", 3.5), ("10 - 2 - 3", 5)],
)
def test_calculator_evaluates_integer_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression, match",
    [
        ("__import__('os').system('true')", "only integers"),
        ("2 ** 1000", "only integers"),
        ("1.5 + 1", "only integers"),
        ("1 / 0", "division by zero"),
        ("3 *", "not an arithmetic expression"),
        ("99999999999999999 * 99999999999999999", "over 30 digits"),
    ],
)
def test_calculator_refuses_anything_but_small_integer_arithmetic(expression, match):
    with pytest.raises(ValueError, match=match):
        evaluate(expression)
    response, _, _ = asyncio.run(CalculatorTool().execute("id", {"expression": expression}))
    assert response.text.startswith("error: ")
