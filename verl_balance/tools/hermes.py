"""Tool calls in the hermes format (Qwen2.5/Qwen3 chat templates, verl's default ``multi_turn.format``):
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in the generated text.

``parse_tool_calls(text)`` returns the text without the blocks and one ``ToolCall`` per block, in order;
a block that is not a JSON object with a string ``name`` and an object ``arguments`` is a ToolCall
whose ``error`` says why (the runner answers it with that error; the sample goes on).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
FORMATS = ("hermes",)


@dataclass(frozen=True)
class ToolCall:
    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def _parse_block(block: str) -> ToolCall:
    try:
        call = json.loads(block)
    except json.JSONDecodeError as e:
        return ToolCall(name=None, error=f"tool call is not valid JSON ({e.msg} at char {e.pos}): {block.strip()!r}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(name=None, error=f"tool call needs a string 'name': {block.strip()!r}")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=call["name"], error=f"arguments of {call['name']!r} must be a JSON object")
    return ToolCall(name=call["name"], arguments=arguments)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(text without the tool-call blocks, the calls in order)."""
    calls = [_parse_block(block) for block in _BLOCK.findall(text)]
    return _BLOCK.sub("", text), calls
