"""A calculator tool (``calculator``): the arithmetic a tiny model cannot do, for the tool-use demo task.

``execute({"expression": "3 * 4 + 5"})`` answers ``17`` for integer ``+ - * /``, unary minus and
parentheses (parsed, never ``eval``); anything else, division by zero or a result over ``MAX_DIGITS``
digits answers ``error: ...``. Stateless: no step reward.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from verl_balance.tools.base import BaseTool, ToolResponse

NAME = "calculator"
SCHEMA = {
    "type": "function",
    "function": {
        "name": NAME,
        "description": "Evaluate an arithmetic expression of integers.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 3 * 4 + 5"}},
            "required": ["expression"],
        },
    },
}
MAX_DIGITS = 30
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> int | float:
    """The value of an integer arithmetic expression; ValueError naming what is not allowed."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_value(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        result = _BINARY[type(node.op)](left, right)
        if abs(result) >= 10**MAX_DIGITS:
            raise ValueError(f"result over {MAX_DIGITS} digits")
        return result
    raise ValueError(f"only integers, + - * / and parentheses are allowed, got {ast.dump(node)[:60]}")


def format_value(value: int | float) -> str:
    """``17`` for an integral value, else the float's repr."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class CalculatorTool(BaseTool):
    def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
        super().__init__(config or {}, tool_schema or SCHEMA)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        try:
            text = format_value(evaluate(str(parameters.get("expression", ""))))
        except ValueError as err:
            text = f"error: {err}"
        return ToolResponse(text=text), 0.0, {}
