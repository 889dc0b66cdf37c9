"""Every tool of a run: the classes of a ``tool_config_path`` YAML plus the functions of a
``function_tool_path`` file, each name once.

The YAML is verl's (``tools: [{class_name, config, tool_schema}]``). A bad entry or a name given
twice is a ToolError naming the entry and the file.
"""

from __future__ import annotations

import importlib
import os

from omegaconf import OmegaConf

from verl_balance.tools.base import SchemaView, ToolError, check_schema
from verl_balance.tools.function_tool import load_function_tools


def _tool_class(class_name: str, *, where: str):
    module_name, _, attr = class_name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ToolError(f"{where}: class_name {class_name!r} cannot be imported ({e})") from e


def load_tool_config(path: str) -> list:
    """The tool objects of a ``tool_config_path`` YAML."""
    if not os.path.isfile(path):
        raise ToolError(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path!r} does not exist")
    entries = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(entries, dict) or not isinstance(entries.get("tools"), list):
        raise ToolError(f"{path}: expected a top-level 'tools:' list")
    tools = []
    for index, entry in enumerate(entries["tools"]):
        where = f"{path} tools[{index}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ToolError(f"{where}: each tool needs class_name (and config, tool_schema)")
        cls = _tool_class(entry["class_name"], where=where)
        schema = SchemaView(check_schema(entry.get("tool_schema"), where=where))
        tools.append(cls(config=entry.get("config") or {}, tool_schema=schema))
    return tools


def load_tools(*, tool_config_path: str | None, function_tool_path: str | None) -> dict:
    """name -> tool (a BaseTool-like object with async lifecycle methods, or a FunctionTool)."""
    tools = list(load_tool_config(tool_config_path)) if tool_config_path else []
    tools += load_function_tools(function_tool_path) if function_tool_path else []
    by_name: dict = {}
    for tool in tools:
        if tool.name in by_name:
            raise ToolError(
                f"tool name {tool.name!r} is given twice (tool_config_path, function_tool_path): names must be unique"
            )
        by_name[tool.name] = tool
    return by_name
