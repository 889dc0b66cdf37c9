"""Tools under verl's names: the YAML of tool classes, ``@function_tool`` files (ours and verl's), verl's
gsm8k example tool, hermes parsing and the runner's error answers."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from verl_balance.tools import ToolError, load_tools
from verl_balance.tools.gsm8k import Gsm8kTool
from verl_balance.tools.hermes import parse_tool_calls
from verl_balance.tools.runner import run_tool_calls, truncate

GSM8K_YAML = """\
tools:
  - class_name: verl_balance.tools.gsm8k.Gsm8kTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calc_gsm8k_reward
        description: the gsm8k checker
        parameters:
          type: object
          properties: {answer: {type: string, description: the answer}}
          required: [answer]
"""


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_a_tool_config_yaml_builds_its_classes_with_their_schemas(tmp_path):
    tools = load_tools(tool_config_path=write(tmp_path, "tools.yaml", GSM8K_YAML), function_tool_path=None)
    assert list(tools) == ["calc_gsm8k_reward"] and isinstance(tools["calc_gsm8k_reward"], Gsm8kTool)
    assert tools["calc_gsm8k_reward"].tool_schema["function"]["description"] == "the gsm8k checker"


@pytest.mark.parametrize(
    "text, match",
    [
        ("tools: [{class_name: no.such.Module}]", "cannot be imported"),
        ("tools: [{config: {}}]", "needs class_name"),
        ("other: 1", "top-level 'tools:' list"),
        (
            "tools: [{class_name: verl_balance.tools.gsm8k.Gsm8kTool, tool_schema: {type: function, function: {}}}]",
            "function.name",
        ),
    ],
)
def test_a_bad_tool_config_names_the_entry(tmp_path, text, match):
    with pytest.raises(ToolError, match=match):
        load_tools(tool_config_path=write(tmp_path, "bad.yaml", text), function_tool_path=None)


FUNCTIONS = '''\
from verl_balance.tools import function_tool


@function_tool
def power(base: int, exponent: int) -> int:
    """Raise a number to a power.

    Args:
        base: the base
        exponent: the exponent
    """
    return base**exponent
'''


def test_a_function_tool_file_registers_its_functions_and_a_name_twice_is_refused(tmp_path):
    tools = load_tools(tool_config_path=None, function_tool_path=write(tmp_path, "fns.py", FUNCTIONS))
    schema = tools["power"].tool_schema["function"]
    assert schema["parameters"]["required"] == ["base", "exponent"]
    response, reward, _ = asyncio.run(tools["power"].call({"base": 2, "exponent": 10}))
    assert response.text == "1024" and reward == 0.0
    clash = write(tmp_path, "clash.yaml", GSM8K_YAML.replace("calc_gsm8k_reward", "power"))
    with pytest.raises(ToolError, match="'power' is given twice"):
        load_tools(tool_config_path=clash, function_tool_path=str(tmp_path / "fns.py"))
    with pytest.raises(ToolError, match="does not exist"):
        load_tools(tool_config_path=None, function_tool_path=str(tmp_path / "missing.py"))


def test_a_file_written_for_verl_runs_unchanged_when_verl_is_installed(tmp_path):
    pytest.importorskip("verl.tools.function_tool")
    path = write(tmp_path, "verl_fns.py", FUNCTIONS.replace("verl_balance.tools", "verl.tools.function_tool"))
    tools = load_tools(tool_config_path=None, function_tool_path=path)
    assert list(tools) == ["power"]
    assert asyncio.run(tools["power"].call({"base": 3, "exponent": 2}))[0].text == "9"


def test_gsm8k_tool_scores_the_answer_and_penalises_a_worse_retry():
    tool = Gsm8kTool()

    async def episode():
        instance, _ = await tool.create(create_kwargs={"ground_truth": "72"})
        right = await tool.execute(instance, {"answer": "72"})
        wrong = await tool.execute(instance, {"answer": "71"})
        final = await tool.calc_reward(instance)
        await tool.release(instance)
        return right, wrong, final

    (right, right_penalty, _), (wrong, wrong_penalty, _), final = asyncio.run(episode())
    assert "reward=1.0" in right.text and right_penalty == 0.0
    assert "reward=0.0" in wrong.text and wrong_penalty == -0.05 and final == 0.0


def test_hermes_blocks_are_parsed_in_order_and_a_malformed_one_is_named():
    text = 'think <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call> then <tool_call>{oops}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "think  then " and [c.name for c in calls] == ["a", None]
    assert calls[0].arguments == {"x": 1} and "not valid JSON" in calls[1].error
    _, [stringly] = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert stringly.arguments == {"x": 2}


def test_truncation_keeps_the_configured_side():
    text = "0123456789"
    assert truncate(text, max_length=4, side="left") == "(truncated)...6789"
    assert truncate(text, max_length=4, side="right") == "0123...(truncated)"
    assert truncate(text, max_length=4, side="middle") == "01...(truncated)...89"
    assert truncate(text, max_length=10, side="middle") == text


def test_a_tool_that_calls_sys_exit_answers_with_an_error_and_the_run_goes_on():
    from verl_balance.tools.base import FunctionTool
    from verl_balance.tools.hermes import ToolCall

    def leaves(x: int) -> int:
        raise SystemExit(0)

    tools = {"leaves": FunctionTool(name="leaves", fn=leaves)}
    [[result]] = run_tool_calls(
        [[ToolCall(name="leaves", arguments={"x": 1})]],
        tools=tools,
        tools_kwargs=[{}],
        timeout_s=5,
        max_parallel_calls=1,
        max_tool_response_length=100,
        truncate_side="middle",
    )
    assert result.error == "raised" and "ToolExitError: the tool called sys.exit(0)" in result.text
