"""Tools for multi-turn RL rollouts, under verl's names and lifecycle (``tool_config_path`` YAML of tool
classes, ``function_tool_path`` files of ``@function_tool`` functions, hermes tool calls).

Modules: ``base`` (the interface), ``function_tool``, ``registry`` (every tool of a run), ``hermes``
(call parsing), ``runner`` (concurrent calls with timeouts), ``gsm8k`` and ``calculator`` (tools).
"""

from verl_balance.tools.base import BaseTool, FunctionTool, ToolError, ToolResponse
from verl_balance.tools.function_tool import function_tool
from verl_balance.tools.registry import load_tools

__all__ = ["BaseTool", "FunctionTool", "ToolError", "ToolResponse", "function_tool", "load_tools"]
