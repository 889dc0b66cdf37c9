"""Multi-turn tool data in verl's layout (its ``gsm8k_multiturn_w_tool`` / tool-agent-loop preprocessing),
with generated arithmetic questions "What is a * b + c?" instead of the hub's gsm8k:

    python -m verl_balance.data.tool_tasks --out DIR [--tool gsm8k|calculator] [--num-train N] [--num-val M]
        [--seed S] [--max-operand K] [--direct-fraction F]

writes ``DIR/{train,val}.parquet`` (RL rows, ``data_source`` ``openai/gsm8k``, ``agent_name``
``tool_agent``, the tool's ``tools_kwargs``), ``DIR/tool_config.yaml`` and ``DIR/sft_{train,val}.parquet``
(verl multi-turn SFT demonstrations: a tool call, its real answer, then ``#### <answer>``).
Tools: ``gsm8k`` (default, verl's example) or ``calculator``. ``--direct-fraction`` of the
demonstrations answer without the tool.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import numpy as np

from verl_balance.batch_keys import INDEX_KEY
from verl_balance.rewards.gsm8k import GSM8K_DATA_SOURCE
from verl_balance.tools import calculator, gsm8k

SYSTEM_PROMPT = (
    "You are a math expert. Solve the question step by step. Call the `calc_gsm8k_reward` tool with "
    "your answer at least once before the final answer, and refine it if needed. Put your final "
    "answer in the format of `#### <answer>`."
)
CALCULATOR_PROMPT = "Use the calculator, then answer as `#### <answer>`."
TOOLS = {
    "gsm8k": (gsm8k.Gsm8kTool, gsm8k.SCHEMA, SYSTEM_PROMPT),
    "calculator": (calculator.CalculatorTool, calculator.SCHEMA, CALCULATOR_PROMPT),
}
"""--tool -> (tool class, tool_schema, system prompt)."""


def tool_config(tool: str) -> dict:
    """The ``tool_config_path`` YAML content of ``tool``."""
    cls, schema, _ = _tool(tool)
    class_name = f"{cls.__module__}.{cls.__qualname__}"
    return {"tools": [{"class_name": class_name, "config": {"type": "native"}, "tool_schema": schema}]}


def _tool(tool: str) -> tuple[type, dict, str]:
    if tool not in TOOLS:
        raise ValueError(f"tool={tool!r} is not valid; valid values: {', '.join(TOOLS)}")
    return TOOLS[tool]


def _questions(*, count: int, split: str, seed: int, max_operand: int) -> list[tuple[str, str, str]]:
    """``count`` (question, expression, answer) triples "What is a * b + c?", operands in [2, max_operand]."""
    if max_operand < 2:
        raise ValueError(f"max_operand={max_operand} must be >= 2")
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    out = []
    for _ in range(count):
        a, b, c = (int(v) for v in rng.integers(2, max_operand + 1, size=3))
        expression = f"{a} * {b} + {c}"
        out.append((f"What is {expression}?", expression, str(a * b + c)))
    return out


def make_rows(*, count: int, split: str, seed: int, tool: str = "gsm8k", max_operand: int = 19) -> list[dict]:
    """``count`` questions in verl's multi-turn tool layout."""
    _, schema, system = _tool(tool)
    name = schema["function"]["name"]
    rows = []
    for index, (question, _, answer) in enumerate(
        _questions(count=count, split=split, seed=seed, max_operand=max_operand)
    ):
        rows.append(
            {
                "data_source": GSM8K_DATA_SOURCE,
                "agent_name": "tool_agent",
                "prompt": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {
                    "split": split,
                    INDEX_KEY: index,
                    "question": question,
                    "need_tools_kwargs": True,
                    "tools_kwargs": {name: {"create_kwargs": {"ground_truth": answer}}},
                },
            }
        )
    return rows


def make_sft_rows(
    *, count: int, split: str, seed: int, tool: str = "gsm8k", max_operand: int = 19, direct_fraction: float = 0.0
) -> list[dict]:
    """Demonstrations of ``make_rows``' questions in verl's multi-turn SFT format (``messages``, ``tools``);
    every ``1 / direct_fraction``-th one answers directly."""
    if not 0.0 <= direct_fraction <= 1.0:
        raise ValueError(f"direct_fraction={direct_fraction} must be in [0, 1]")
    cls, schema, system = _tool(tool)
    name = schema["function"]["name"]
    instance = cls(config={}, tool_schema=schema)
    rows = []
    for index, (question, expression, answer) in enumerate(
        _questions(count=count, split=split, seed=seed, max_operand=max_operand)
    ):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        if int((index + 1) * direct_fraction) == int(index * direct_fraction):
            arguments = {"expression": expression} if tool == "calculator" else {"answer": answer}
            call = {"type": "function", "function": {"name": name, "arguments": arguments}}
            answer_text = asyncio.run(_call_once(instance, arguments, {"ground_truth": answer}))
            messages += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": answer_text},
            ]
        messages.append({"role": "assistant", "content": f"#### {answer}"})
        rows.append({"messages": messages, "tools": [schema]})
    return rows


async def _call_once(tool, arguments: dict, create_kwargs: dict) -> str:
    """The tool's answer to one call, through its lifecycle (create, execute, release)."""
    instance_id, _ = await tool.create(create_kwargs=create_kwargs)
    try:
        response, _, _ = await tool.execute(instance_id, arguments)
    finally:
        await tool.release(instance_id)
    return response.text


def write_dataset(
    out: str,
    *,
    num_train: int = 256,
    num_val: int = 32,
    seed: int = 0,
    tool: str = "gsm8k",
    max_operand: int = 19,
    direct_fraction: float = 0.0,
) -> dict[str, str]:
    """Write the RL and SFT parquet files and the tool config under ``out``; returns their paths
    (keys train, val, sft_train, sft_val, tool_config)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    os.makedirs(out, exist_ok=True)
    paths = {}
    task = dict(seed=seed, tool=tool, max_operand=max_operand)
    for split, count in (("train", num_train), ("val", num_val)):
        paths[split] = os.path.join(out, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(make_rows(count=count, split=split, **task)), paths[split])
        paths[f"sft_{split}"] = os.path.join(out, f"sft_{split}.parquet")
        rows = make_sft_rows(count=count, split=split, direct_fraction=direct_fraction, **task)
        pq.write_table(pa.Table.from_pylist(rows), paths[f"sft_{split}"])
    paths["tool_config"] = os.path.join(out, "tool_config.yaml")
    OmegaConf.save(OmegaConf.create(tool_config(tool)), paths["tool_config"])
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-train", type=int, default=256)
    parser.add_argument("--num-val", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tool", choices=sorted(TOOLS), default="gsm8k")
    parser.add_argument("--max-operand", type=int, default=19, help="operands a, b, c in [2, K]")
    parser.add_argument("--direct-fraction", type=float, default=0.0, help="demonstrations without the tool")
    args = parser.parse_args(argv)
    paths = write_dataset(
        args.out,
        num_train=args.num_train,
        num_val=args.num_val,
        seed=args.seed,
        tool=args.tool,
        max_operand=args.max_operand,
        direct_fraction=args.direct_fraction,
    )
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
