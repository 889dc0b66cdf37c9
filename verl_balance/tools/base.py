"""The tool interface: verl's lifecycle (``create`` -> ``execute`` -> ``calc_reward`` -> ``release``),
whose methods may be plain functions or coroutines (a verl ``BaseTool`` subclass is async).

Invariants:
- A tool sees only its own arguments: the instance id, the call's parsed arguments and the sample's
  ``tools_kwargs`` entry for that tool; never the trainer's, the rollout's or another sample's objects.
- ``execute`` returns ``(ToolResponse, step reward, metrics)`` (``normalize_return`` of a function
  tool's return).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class ToolError(ValueError):
    """A tool configuration that cannot be used (bad YAML, unknown class, duplicate name, bad schema)."""


@dataclass(frozen=True)
class ToolResponse:
    """What a tool call returns to the model (text only: this trainer has no vision tools)."""

    text: str = ""


def check_schema(schema: Any, *, where: str) -> dict:
    """An OpenAI function-tool schema (``{"type": "function", "function": {"name", "description",
    "parameters"}}``) as a plain dict; ToolError naming ``where`` otherwise."""
    if hasattr(schema, "model_dump"):  # verl's pydantic OpenAIFunctionToolSchema
        schema = schema.model_dump(exclude_unset=True, exclude_none=True)
    if not isinstance(schema, Mapping) or not isinstance(schema.get("function"), Mapping):
        raise ToolError(f"{where}: tool_schema must be {{'type': 'function', 'function': {{'name': ...}}}}")
    function = schema["function"]
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolError(f"{where}: tool_schema.function.name must be a non-empty string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping) or not isinstance(parameters.get("properties", {}), Mapping):
        raise ToolError(f"{where}: tool_schema.function.parameters must be an object schema with properties")
    return {"type": schema.get("type", "function"), "function": {**dict(function), "parameters": dict(parameters)}}


class SchemaView(dict):
    """A tool schema dict that also reads as attributes and answers ``model_dump()`` (as verl tools expect)."""

    def __getattr__(self, name: str) -> Any:
        try:
            value = self[name]
        except KeyError:
            raise AttributeError(name) from None
        return SchemaView(value) if isinstance(value, Mapping) else value

    def model_dump(self, **_: Any) -> dict:
        return json.loads(json.dumps(self))


class ToolExitError(RuntimeError):
    """A tool called ``sys.exit``: an error of that call, never the end of the run."""


def _no_exit(fn: Callable, *args, **kwargs) -> Any:
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:
        raise ToolExitError(f"the tool called sys.exit({e.code!r})") from None


async def call_maybe_async(fn: Callable, *args, **kwargs) -> Any:
    """``fn(*args, **kwargs)``: awaited when it is a coroutine function, else run in a thread; a
    ``SystemExit`` it raises becomes ``ToolExitError`` before it can reach the event loop."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await fn(*args, **kwargs)
        result = await asyncio.to_thread(_no_exit, fn, *args, **kwargs)
        return await result if inspect.isawaitable(result) else result
    except SystemExit as e:
        raise ToolExitError(f"the tool called sys.exit({e.code!r})") from None


class BaseTool:
    """A stateful tool. Subclasses override ``execute`` (and ``create``/``calc_reward``/``release``
    when they keep per-trajectory state). ``config`` is the YAML entry's ``config``."""

    def __init__(self, config: Mapping[str, Any], tool_schema: Mapping[str, Any]):
        self.config = dict(config)
        self.tool_schema = check_schema(tool_schema, where=type(self).__name__)
        self.name = self.tool_schema["function"]["name"]

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


@dataclass
class FunctionTool:
    """A stateless tool: a Python function and its schema (no lifecycle; ``tools_kwargs`` unused)."""

    name: str
    fn: Callable[..., Any]
    tool_schema: dict = field(default_factory=dict)

    async def call(self, parameters: dict[str, Any]) -> tuple[ToolResponse, float, dict]:
        return normalize_return(await call_maybe_async(self.fn, **parameters))


def _response(value: Any) -> ToolResponse:
    if isinstance(value, ToolResponse):
        return value
    if hasattr(value, "text") and not isinstance(value, str):  # verl's pydantic ToolResponse
        return ToolResponse(text=value.text or "")
    if isinstance(value, Mapping):
        return ToolResponse(text=json.dumps(value, ensure_ascii=False))
    return ToolResponse(text=str(value))


def normalize_return(value: Any) -> tuple[ToolResponse, float, dict]:
    """A tool's return as (response, reward, metrics); a tuple of 0 or 4+ items is a TypeError."""
    if not isinstance(value, tuple):
        return _response(value), 0.0, {}
    if not 1 <= len(value) <= 3:
        raise TypeError(f"a tool returned a tuple of {len(value)} items; expected (response[, reward[, metrics]])")
    reward = 0.0 if len(value) < 2 or value[1] is None else float(value[1])
    metrics = {} if len(value) < 3 or value[2] is None else dict(value[2])
    return _response(value[0]), reward, metrics
