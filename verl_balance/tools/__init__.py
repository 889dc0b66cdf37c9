"""Tools for multi-turn RL rollouts, under verl's names and lifecycle (``tool_config_path`` YAML of tool
classes, ``function_tool_path`` files of ``@function_tool`` functions, hermes tool calls).

- ``base``: ``ToolResponse``, ``BaseTool`` (create -> execute -> calc_reward -> release) and
  ``FunctionTool`` (a stateless function);
- ``function_tool``: the ``@function_tool`` decorator (schema from the signature and docstring) and the
  loader of a ``function_tool_path`` file;
- ``registry``: every tool of a run, from both paths, names unique;
- ``hermes``: tool calls parsed out of generated text (``<tool_call>{json}</tool_call>``);
- ``runner``: calls run concurrently with a timeout, errors returned to the model as text;
- ``gsm8k``: verl's example tool, a gsm8k answer checker;
- ``calculator``: integer arithmetic, the tool of the tool-use demo (``recipes/grpo_tool_cpu_demo.sh``).
"""

from verl_balance.tools.base import BaseTool, FunctionTool, ToolError, ToolResponse
from verl_balance.tools.function_tool import function_tool
from verl_balance.tools.registry import load_tools

__all__ = ["BaseTool", "FunctionTool", "ToolError", "ToolResponse", "function_tool", "load_tools"]
