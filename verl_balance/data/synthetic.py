"""Seeded synthetic tasks with widely varying lengths, written as verl SFT and RL parquet files.

Tasks (data_source ``synthetic/<task>``), each a short prompt and one verifiable answer:

- ``add``:     "<a>+<b>="         -> decimal sum, operands with n digits
- ``reverse``: "reverse <s>"      -> s reversed, s of n lowercase letters
- ``sort``:    "sort <d>"         -> the digits of d in ascending order, n digits
- ``copy``:    "copy <s>"         -> s, n lowercase letters

The size n is lognormal (median ``median_size``, shape ``sigma``), clipped to [``min_size``, ``max_size``].
``sft_defect_rate`` (default 0) of the SFT *train* rows answer with their last character repeated;
RL and validation rows stay exact.

Invariants: the same (config, seed, sft_defect_rate) gives the same rows, byte for byte; train, val
and the defect draws use independent streams of one seed, so growing one split never changes another.
"""

from __future__ import annotations

import argparse
import os
import string
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from verl_balance.utils.atomic_io import atomic_write_bytes

TASKS = ("add", "reverse", "sort", "copy")
DATA_SOURCE_PREFIX = "synthetic/"


class SyntheticConfigError(ValueError):
    """An invalid synthetic-data setting."""


@dataclass(frozen=True)
class SyntheticConfig:
    """Task mix and size distribution of the synthetic data."""

    tasks: tuple[str, ...] = TASKS
    median_size: float = 8.0
    sigma: float = 1.0
    min_size: int = 1
    max_size: int = 96

    def __post_init__(self):
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown or not self.tasks:
            raise SyntheticConfigError(f"tasks={list(self.tasks)} invalid; choose a non-empty subset of {list(TASKS)}")
        if not 1 <= self.min_size <= self.max_size:
            raise SyntheticConfigError(f"need 1 <= min_size <= max_size, got {self.min_size}, {self.max_size}")
        if self.median_size <= 0 or self.sigma < 0:
            raise SyntheticConfigError(f"need median_size > 0 and sigma >= 0, got {self.median_size}, {self.sigma}")


@dataclass(frozen=True)
class SyntheticSample:
    """One task instance: the user prompt, the exact answer, and its size parameter."""

    task: str
    prompt: str
    answer: str
    size: int

    @property
    def data_source(self) -> str:
        return DATA_SOURCE_PREFIX + self.task


def _letters(rng: np.random.Generator, n: int) -> str:
    return "".join(rng.choice(list(string.ascii_lowercase), size=n))


def _number(rng: np.random.Generator, n: int) -> int:
    first = str(rng.integers(1, 10)) if n > 1 else str(rng.integers(0, 10))
    return int(first + "".join(str(d) for d in rng.integers(0, 10, size=n - 1)))


def _make_add(rng: np.random.Generator, n: int) -> tuple[str, str]:
    a, b = _number(rng, n), _number(rng, int(rng.integers(1, n + 1)))
    if rng.random() < 0.5:
        a, b = b, a
    return f"{a}+{b}=", str(a + b)


def _make_reverse(rng: np.random.Generator, n: int) -> tuple[str, str]:
    s = _letters(rng, n)
    return f"reverse {s}", s[::-1]


def _make_sort(rng: np.random.Generator, n: int) -> tuple[str, str]:
    digits = "".join(str(d) for d in rng.integers(0, 10, size=n))
    return f"sort {digits}", "".join(sorted(digits))


def _make_copy(rng: np.random.Generator, n: int) -> tuple[str, str]:
    s = _letters(rng, n)
    return f"copy {s}", s


_MAKERS: dict[str, Callable[[np.random.Generator, int], tuple[str, str]]] = {
    "add": _make_add,
    "reverse": _make_reverse,
    "sort": _make_sort,
    "copy": _make_copy,
}


def generate_samples(
    *, num_samples: int, seed: int, config: SyntheticConfig = SyntheticConfig(), progress: str | None = None
) -> list[SyntheticSample]:
    """``num_samples`` task instances drawn from one seeded stream (deterministic); ``progress``
    names a tqdm bar on stderr (None: silent)."""
    if num_samples < 0:
        raise SyntheticConfigError(f"num_samples must be >= 0, got {num_samples}")
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(mean=np.log(config.median_size), sigma=config.sigma, size=num_samples)
    sizes = np.clip(np.rint(sizes), config.min_size, config.max_size).astype(np.int64)
    tasks = rng.choice(np.array(config.tasks), size=num_samples)
    samples = []
    pairs = zip(tasks.tolist(), sizes.tolist())
    if progress is not None:
        from tqdm import tqdm

        from verl_balance.utils.run_log import console_stream

        # On a terminal only (disable=None), never into the run log (no carriage returns there).
        pairs = tqdm(
            pairs, total=num_samples, desc=progress, unit="sample", file=console_stream(sys.stderr), disable=None
        )
    for task, size in pairs:
        prompt, answer = _MAKERS[task](rng, size)
        samples.append(SyntheticSample(task=task, prompt=prompt, answer=answer, size=size))
    return samples


def sft_rows(samples: Sequence[SyntheticSample], *, defective: Sequence[bool] | None = None) -> dict[str, list]:
    """Columns of verl's SFT schema: prompt/response strings and the same pair as ``messages``;
    a row marked ``defective`` answers with its last character repeated."""
    defective = [False] * len(samples) if defective is None else defective
    responses = [s.answer + s.answer[-1] if bad else s.answer for s, bad in zip(samples, defective, strict=True)]
    return {
        "prompt": [s.prompt for s in samples],
        "response": responses,
        "messages": [
            [{"role": "user", "content": s.prompt}, {"role": "assistant", "content": r}]
            for s, r in zip(samples, responses)
        ],
        "data_source": [s.data_source for s in samples],
    }


def rl_rows(samples: Sequence[SyntheticSample], *, split: str) -> dict[str, list]:
    """Columns of verl's RL schema (data_source, chat prompt, rule reward_model, extra_info)."""
    return {
        "data_source": [s.data_source for s in samples],
        "prompt": [[{"role": "user", "content": s.prompt}] for s in samples],
        "ability": ["synthetic" for _ in samples],
        "reward_model": [{"style": "rule", "ground_truth": s.answer} for s in samples],
        "extra_info": [{"split": split, "index": i, "task": s.task, "size": s.size} for i, s in enumerate(samples)],
    }


def write_parquet(columns: dict[str, list], path: str) -> None:
    """Write columns to one parquet file (pyarrow infers nested list/struct types)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())  # a link at ``path`` is replaced, not written through


def write_dataset(
    *,
    out_dir: str,
    num_train: int,
    num_val: int,
    seed: int,
    config: SyntheticConfig = SyntheticConfig(),
    sft_defect_rate: float = 0.0,
    progress: bool = False,
) -> dict[str, str]:
    """Write ``sft_{train,val}.parquet`` and ``rl_{train,val}.parquet``; returns name -> path.
    ``sft_defect_rate``: the fraction of SFT train rows given a defect (module docstring)."""
    if not 0 <= sft_defect_rate <= 1:
        raise SyntheticConfigError(f"sft_defect_rate={sft_defect_rate} must be in [0, 1]")
    os.makedirs(out_dir, exist_ok=True)
    train_seed, val_seed, defect_seed = np.random.SeedSequence(seed).spawn(3)
    splits = {"train": (num_train, train_seed), "val": (num_val, val_seed)}
    paths = {}
    for split, (count, split_seed) in splits.items():
        samples = generate_samples(
            num_samples=count,
            seed=split_seed.generate_state(1)[0],
            config=config,
            progress=f"synthetic {split}" if progress else None,
        )
        defective = None
        if split == "train" and sft_defect_rate > 0:
            defective = np.random.default_rng(defect_seed).random(count) < sft_defect_rate
        for kind, rows in (("sft", sft_rows(samples, defective=defective)), ("rl", rl_rows(samples, split=split))):
            path = os.path.join(out_dir, f"{kind}_{split}.parquet")
            write_parquet(rows, path)
            paths[f"{kind}_{split}"] = path
        if progress:
            sizes = np.array([s.size for s in samples]) if samples else np.zeros(1)
            print(
                f"[synthetic] {split}: {count} samples, size min/median/max = "
                f"{sizes.min()}/{int(np.median(sizes))}/{sizes.max()} -> {out_dir}/{{sft,rl}}_{split}.parquet",
                file=sys.stderr,
            )
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: ``python -m verl_balance.data.synthetic --out DIR --num-train N --num-val M --seed S``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--num-train", type=int, default=2048)
    parser.add_argument("--num-val", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    parser.add_argument("--median-size", type=float, default=SyntheticConfig.median_size)
    parser.add_argument("--sigma", type=float, default=SyntheticConfig.sigma)
    parser.add_argument("--max-size", type=int, default=SyntheticConfig.max_size)
    parser.add_argument(
        "--sft-defect-rate",
        type=float,
        default=0.0,
        help="fraction of SFT train answers with their last character repeated (imperfect demonstrations)",
    )
    args = parser.parse_args(argv)
    config = SyntheticConfig(
        tasks=tuple(t for t in args.tasks.split(",") if t),
        median_size=args.median_size,
        sigma=args.sigma,
        max_size=args.max_size,
    )
    paths = write_dataset(
        out_dir=args.out,
        num_train=args.num_train,
        num_val=args.num_val,
        seed=args.seed,
        config=config,
        sft_defect_rate=args.sft_defect_rate,
        progress=True,
    )
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
