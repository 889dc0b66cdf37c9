"""``@function_tool``: a Python function as a stateless tool, its OpenAI schema taken from its signature
and Google-style docstring (as verl does), and the loader of a ``multi_turn.function_tool_path`` file.

Invariants:
- The decorator returns the function unchanged and registers it under its name (or the given one);
  a second function under a taken name is a ToolError naming both.
- ``load_function_tools(path)`` runs the file once per process; verl's decorator is read too (this
  package never imports verl).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from verl_balance.tools.base import FunctionTool, ToolError, check_schema

FUNCTION_TOOLS: dict[str, FunctionTool] = {}
_LOADED: dict[str, list[FunctionTool]] = {}
# verl's decorator module: a file written for verl registers its functions there.
_VERL_FUNCTION_TOOL_MODULE = "verl.tools.function_tool"


def _schema_of(fn: Callable, name: str) -> dict:
    from transformers.utils import get_json_schema

    variadic = [
        p.name for p in inspect.signature(fn).parameters.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if variadic:
        raise ToolError(f"@function_tool {name!r}: variadic parameters {variadic} have no JSON schema; name them")
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
        raise ToolError(f"@function_tool {name!r}: {e} (a docstring with Args: and a type hint per parameter)") from e
    schema["function"]["name"] = name
    return check_schema(schema, where=f"@function_tool {name!r}")


def function_tool(name: str | Callable | None = None, *, schema: Mapping[str, Any] | None = None):
    """Register a function as a tool: ``@function_tool``, ``@function_tool("name")`` or with ``schema=``."""

    def decorate(fn: Callable, tool_name: str | None) -> Callable:
        tool_name = tool_name or fn.__name__
        built = check_schema(schema, where=tool_name) if schema is not None else _schema_of(fn, tool_name)
        existing = FUNCTION_TOOLS.get(tool_name)
        if existing is not None and existing.fn is not fn:
            raise ToolError(
                f"function tool {tool_name!r} is already registered to {existing.fn.__module__}."
                f"{existing.fn.__qualname__}; rename {fn.__module__}.{fn.__qualname__}"
            )
        FUNCTION_TOOLS[tool_name] = FunctionTool(name=tool_name, fn=fn, tool_schema=built)
        return fn

    if callable(name):
        return decorate(name, None)
    return lambda fn: decorate(fn, name)


def _verl_registered() -> dict[str, FunctionTool]:
    module = sys.modules.get(_VERL_FUNCTION_TOOL_MODULE)
    registry = getattr(module, "FUNCTION_TOOL_REGISTRY", {}) if module is not None else {}
    return {
        name: FunctionTool(name=name, fn=entry.fn, tool_schema=check_schema(entry.tool_schema, where=name))
        for name, entry in registry.items()
    }


def load_function_tools(path: str) -> list[FunctionTool]:
    """The tools a ``function_tool_path`` file registers (run once per process)."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise ToolError(f"actor_rollout_ref.rollout.multi_turn.function_tool_path={path!r} does not exist")
    if path in _LOADED:
        return _LOADED[path]
    before, verl_before = set(FUNCTION_TOOLS), set(_verl_registered())
    module_name = "_verl_balance_function_tools_" + path.replace(os.sep, "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    verl_tools = _verl_registered()
    found = [FUNCTION_TOOLS[n] for n in sorted(set(FUNCTION_TOOLS) - before)]
    found += [verl_tools[n] for n in sorted(set(verl_tools) - verl_before)]
    if not found:
        raise ToolError(f"function_tool_path={path!r} defines no @function_tool function")
    _LOADED[path] = found
    return found
