"""Running one turn's tool calls: concurrently, each under a timeout, every failure an answer.

Invariants:
- Every call gets exactly one text answer, in call order: the tool's response (truncated to
  ``max_tool_response_length`` characters) or a whole error message; an error never ends the rollout,
  it is counted (``CallResult.error``).
- At most ``max_parallel_calls`` calls of one sample's turn run (verl's rule: the rest are dropped).
- A stateful tool's instance is created with the sample's ``create_kwargs`` and always released.
- A coroutine tool is cancelled at its timeout; a plain function's thread is abandoned.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from verl_balance.tools.base import FunctionTool, call_maybe_async, normalize_return
from verl_balance.tools.hermes import ToolCall

TRUNCATE_SIDES = ("left", "middle", "right")


@dataclass(frozen=True)
class CallResult:
    text: str
    reward: float = 0.0
    error: str | None = None
    seconds: float = 0.0


def truncate(text: str, *, max_length: int, side: str) -> str:
    if len(text) <= max_length:
        return text
    if side == "left":
        return "(truncated)..." + text[-max_length:]
    if side == "right":
        return text[:max_length] + "...(truncated)"
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half :]


async def _execute(tool, call: ToolCall, tools_kwargs: Mapping) -> tuple:
    if isinstance(tool, FunctionTool):
        return await tool.call(call.arguments)
    kwargs = tools_kwargs.get(call.name, {}) or {}
    instance_id, _ = await call_maybe_async(tool.create, create_kwargs=kwargs.get("create_kwargs", {}))
    try:
        return normalize_return(await call_maybe_async(tool.execute, instance_id, call.arguments))
    finally:
        await call_maybe_async(tool.release, instance_id)


async def _one(call: ToolCall, tools: Mapping, tools_kwargs: Mapping, timeout_s: float) -> CallResult:
    start = time.perf_counter()
    if call.error is not None:
        return CallResult(text=f"Error: {call.error}", error="malformed")
    if call.name not in tools:
        return CallResult(text=f"Error: unknown tool {call.name!r}; available tools: {sorted(tools)}", error="unknown")
    try:
        response, reward, _ = await asyncio.wait_for(_execute(tools[call.name], call, tools_kwargs), timeout_s)
        return CallResult(text=response.text, reward=reward, seconds=time.perf_counter() - start)
    except asyncio.TimeoutError:
        text = f"Error: tool {call.name!r} did not answer within {timeout_s:g} s"
        return CallResult(text=text, error="timeout", seconds=time.perf_counter() - start)
    except Exception as e:  # a tool's own failure is the model's answer, not the run's end
        text = f"Error executing tool {call.name!r}: {type(e).__name__}: {e}"
        return CallResult(text=text, error="raised", seconds=time.perf_counter() - start)


async def _all(turns, tools, tools_kwargs, timeout_s):
    jobs = [_one(call, tools, kw, timeout_s) for calls, kw in zip(turns, tools_kwargs) for call in calls]
    return await asyncio.gather(*jobs)


def run_tool_calls(
    turns: Sequence[Sequence[ToolCall]],
    *,
    tools: Mapping,
    tools_kwargs: Sequence[Mapping],
    timeout_s: float,
    max_parallel_calls: int,
    max_tool_response_length: int,
    truncate_side: str,
) -> list[list[CallResult]]:
    """One list of results per sample, one result per call kept (``max_parallel_calls``)."""
    kept = [list(calls)[:max_parallel_calls] for calls in turns]
    flat = asyncio.run(_all(kept, tools, tools_kwargs, timeout_s))
    results, position = [], 0
    for calls in kept:
        chunk = flat[position : position + len(calls)]
        position += len(calls)
        results.append(
            [
                CallResult(
                    text=r.text
                    if r.error
                    else truncate(r.text, max_length=max_tool_response_length, side=truncate_side),
                    reward=r.reward,
                    error=r.error,
                    seconds=r.seconds,
                )
                for r in chunk
            ]
        )
    return results
