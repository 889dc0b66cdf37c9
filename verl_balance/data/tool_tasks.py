"""Multi-turn tool data in verl's layout (its ``gsm8k_multiturn_w_tool`` / tool-agent-loop preprocessing),
with generated arithmetic questions instead of the hub's gsm8k:

    python -m verl_balance.data.tool_tasks --out DIR [--num-train N] [--num-val M] [--seed S]

writes ``DIR/{train,val}.parquet``, one row per question: ``data_source`` (``openai/gsm8k``, so the
built-in gsm8k rule scores the final ``#### <answer>``), ``agent_name`` (``tool_agent``), ``prompt``
(a system message asking to check the answer with the ``calc_gsm8k_reward`` tool, then the question),
``ability``, ``reward_model`` ({``style``: ``rule``, ``ground_truth``}) and ``extra_info`` (``split``,
``index``, ``question``, ``need_tools_kwargs``, ``tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth``),
and ``DIR/tool_config.yaml`` (the ``tools.gsm8k.Gsm8kTool`` entry for ``multi_turn.tool_config_path``).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from verl_balance.batch_keys import INDEX_KEY
from verl_balance.rewards.gsm8k import GSM8K_DATA_SOURCE
from verl_balance.tools.gsm8k import SCHEMA

SYSTEM_PROMPT = (
    "You are a math expert. Solve the question step by step. Call the `calc_gsm8k_reward` tool with "
    "your answer at least once before the final answer, and refine it if needed. Put your final "
    "answer in the format of `#### <answer>`."
)
TOOL_CONFIG = {
    "tools": [{"class_name": "verl_balance.tools.gsm8k.Gsm8kTool", "config": {"type": "native"}, "tool_schema": SCHEMA}]
}


def make_rows(*, count: int, split: str, seed: int) -> list[dict]:
    """``count`` questions "What is a * b + c?" in verl's multi-turn tool layout."""
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    rows = []
    for index in range(count):
        a, b, c = (int(v) for v in rng.integers(2, 20, size=3))
        question = f"What is {a} * {b} + {c}?"
        answer = str(a * b + c)
        rows.append(
            {
                "data_source": GSM8K_DATA_SOURCE,
                "agent_name": "tool_agent",
                "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": answer},
                "extra_info": {
                    "split": split,
                    INDEX_KEY: index,
                    "question": question,
                    "need_tools_kwargs": True,
                    "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": answer}}},
                },
            }
        )
    return rows


def write_dataset(out: str, *, num_train: int = 256, num_val: int = 32, seed: int = 0) -> dict[str, str]:
    """Write the two parquet files and the tool config under ``out``; returns their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from omegaconf import OmegaConf

    os.makedirs(out, exist_ok=True)
    paths = {}
    for split, count in (("train", num_train), ("val", num_val)):
        paths[split] = os.path.join(out, f"{split}.parquet")
        pq.write_table(pa.Table.from_pylist(make_rows(count=count, split=split, seed=seed)), paths[split])
    paths["tool_config"] = os.path.join(out, "tool_config.yaml")
    OmegaConf.save(OmegaConf.create(TOOL_CONFIG), paths["tool_config"])
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-train", type=int, default=256)
    parser.add_argument("--num-val", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, path in write_dataset(args.out, num_train=args.num_train, num_val=args.num_val, seed=args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
