"""SFT dataset build: rows/s and driver bytes/token, compact store vs the original per-row build.

Generates a prompt/response parquet locally (lognormal sample lengths, mean about 450 tokens with
the byte tokenizer; written in row groups, so generating 1M rows needs little memory), then builds
the dataset in a fresh subprocess per case and reports:

- build s, cpu s, rows/s: wall and process CPU time of ``SFTDataset(...)`` (or the original build),
  and the row rate (wall);
- tokens: total stored tokens;
- store B/tok: bytes of the arrays the dataset keeps, per token (``SFTDataset.nbytes``; for the
  original build, the int64 arrays plus numpy's per-array overhead);
- retained B/tok: resident memory after the build minus before it, per token;
- peak B/tok: peak resident memory during the build minus before it, per token.

Each child first warms Arrow's reader (its thread pool and allocator arenas, ~35 MB once per
process), so the memory columns are what grows with the data; at 10k rows a fixed ~40 MB of
Python/Arrow allocator state still weighs in, so read the per-token columns at 100k and 1M.

"original" is the build of commit 450ed95 (``table.to_pylist()``, per-row ``tokenize_chat``, two
int64 numpy arrays per sample), reproduced below so it runs side by side; it is skipped above
``--original-max-rows`` (its memory at 1M rows would not fit a shared machine).

``--dataset rl`` does the same for the RL prompt dataset (verl's RL schema, one user message of
lognormal length, mean ~200 tokens); its original build kept one ``RLPrompt`` (int64 ids, Python
chat and reward dicts) per row, so its store column is "-" (Python objects: see retained).

    PYTHONPATH=. python benchmarks/data_bench.py                  # SFT: 10k, 100k, 1M rows
    PYTHONPATH=. python benchmarks/data_bench.py --rows 10000 100000 --original-max-rows 100000
    PYTHONPATH=. python benchmarks/data_bench.py --dataset rl --rows 10000 100000 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

MEAN_TOKENS = 450.0
SIGMA = 0.8
PROMPT_FRACTION = 0.3
ROW_GROUP = 50_000


def write_parquet(path: str, *, num_rows: int, seed: int = 0) -> None:
    """prompt/response rows of lowercase ASCII; prompt+response bytes are lognormal, mean ~447 (+3 specials)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    mu = np.log(MEAN_TOKENS - 3) - SIGMA**2 / 2
    letters = rng.integers(ord("a"), ord("z") + 1, size=1 << 20, dtype=np.uint8)
    with pq.ParquetWriter(path, pa.schema([("prompt", pa.string()), ("response", pa.string())])) as writer:
        for start in range(0, num_rows, ROW_GROUP):
            n = min(ROW_GROUP, num_rows - start)
            total = np.maximum(2, np.rint(rng.lognormal(mu, SIGMA, size=n))).astype(np.int64)
            total = np.minimum(total, len(letters) // 2)
            prompt_len = np.maximum(1, (total * PROMPT_FRACTION).astype(np.int64))
            response_len = total - prompt_len
            columns = []
            for lengths in (prompt_len, response_len):
                offsets = np.zeros(n + 1, dtype=np.int32)
                np.cumsum(lengths, out=offsets[1:])
                shifts = rng.integers(0, len(letters) // 2, size=n)
                data = np.concatenate([letters[s : s + k] for s, k in zip(shifts, lengths)])
                columns.append(pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)]))
            writer.write_table(pa.table({"prompt": columns[0], "response": columns[1]}))


RL_MEAN_TOKENS = 200.0


def write_rl_parquet(path: str, *, num_rows: int, seed: int = 0) -> None:
    """verl RL rows: data_source, prompt = [one user message] (lognormal length), reward_model, extra_info."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    mu = np.log(RL_MEAN_TOKENS - 2) - SIGMA**2 / 2
    letters = rng.integers(ord("a"), ord("z") + 1, size=1 << 20, dtype=np.uint8)
    tables = []
    for start in range(0, num_rows, ROW_GROUP):
        n = min(ROW_GROUP, num_rows - start)
        lengths = np.clip(np.rint(rng.lognormal(mu, SIGMA, size=n)), 1, len(letters) // 2).astype(np.int64)
        offsets = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        shifts = rng.integers(0, len(letters) // 2, size=n)
        data = np.concatenate([letters[s : s + k] for s, k in zip(shifts, lengths)])
        content = pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)])
        message = pa.StructArray.from_arrays([pa.array(["user"] * n), content], names=["role", "content"])
        prompt = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), message)
        truth = pa.array([str(i) for i in range(start, start + n)])
        reward = pa.StructArray.from_arrays([pa.array(["rule"] * n), truth], names=["style", "ground_truth"])
        tables.append(pa.table({"data_source": pa.array(["bench"] * n), "prompt": prompt, "reward_model": reward}))
    with pq.ParquetWriter(path, tables[0].schema) as writer:
        for table in tables:
            writer.write_table(table)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _original_build(path: str):
    """The SFT build of commit 450ed95: whole table to Python dicts, per-row tokenize, int64 arrays."""
    import pyarrow.parquet as pq

    from verl_balance.data import ByteTokenizer, tokenize_chat

    tokenizer = ByteTokenizer()
    input_ids_list, loss_mask_list, origin = [], [], []
    table = pq.read_table(path, columns=["prompt", "response"])
    for row_index, row in enumerate(table.to_pylist()):
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
        input_ids, loss_mask = tokenize_chat(tokenizer, messages)
        loss_mask[0] = 0
        input_ids_list.append(np.asarray(input_ids, dtype=np.int64))
        loss_mask_list.append(np.asarray(loss_mask, dtype=np.int64))
        origin.append((path, row_index))
    del table
    tokens = sum(len(x) for x in input_ids_list)
    # data plus numpy's ~112-byte array header, twice per sample
    store = sum(x.nbytes + m.nbytes + 2 * 112 for x, m in zip(input_ids_list, loss_mask_list))
    return (input_ids_list, loss_mask_list, origin), tokens, store


def _original_rl_build(path: str):
    """The RL build of commit 450ed95: whole table to Python dicts, one RLPrompt (int64 ids) per row."""
    import pyarrow.parquet as pq

    from verl_balance.data import ByteTokenizer, RLPrompt

    tokenizer, prompts = ByteTokenizer(), []
    table = pq.read_table(path, columns=["prompt", "data_source", "reward_model"])
    for row in table.to_pylist():
        messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        reward_model = dict(row["reward_model"])
        prompts.append(
            RLPrompt(
                prompt_ids=np.asarray(ids, dtype=np.int64),
                raw_prompt=messages,
                data_source=row["data_source"],
                ground_truth=reward_model["ground_truth"],
                reward_model=reward_model,
                extra_info={},
                index=len(prompts),
            )
        )
    del table
    return prompts, sum(len(p.prompt_ids) for p in prompts), None


def _new_rl_build(path: str):
    from verl_balance.data import ByteTokenizer, RLDataConfig, RLPromptDataset

    dataset = RLPromptDataset(files=path, tokenizer=ByteTokenizer(), config=RLDataConfig(max_prompt_length=1 << 20))
    return dataset, int(dataset.prompt_lens.sum()), dataset.nbytes


def _new_build(path: str):
    from verl_balance.data import ByteTokenizer, SFTDataConfig, SFTDataset

    dataset = SFTDataset(files=path, tokenizer=ByteTokenizer(), config=SFTDataConfig(max_length=1 << 20))
    return dataset, int(dataset.seq_lens.sum()), dataset.nbytes


BUILDS = {
    ("sft", "original"): _original_build,
    ("sft", "compact"): _new_build,
    ("rl", "original"): _original_rl_build,
    ("rl", "compact"): _new_rl_build,
}


def _child(dataset: str, impl: str, path: str) -> None:
    import pyarrow.parquet  # noqa: F401  (imports outside the measured window)
    import torch  # noqa: F401
    import tqdm  # noqa: F401

    import verl_balance.data  # noqa: F401

    # Arrow's first read starts its thread pool and allocator arenas (~35 MB, once per process);
    # warm it so the figures below are what grows with the data.
    next(pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=16))
    before = _rss_bytes()
    start, cpu_start = time.perf_counter(), time.process_time()
    kept, tokens, store = BUILDS[dataset, impl](path)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = _rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = len(kept[0]) if (dataset, impl) == ("sft", "original") else len(kept)
    print(
        json.dumps(
            {
                "rows": rows,
                "tokens": tokens,
                "seconds": elapsed,
                "cpu": cpu,
                "store": store,
                "retained": after - before,
                "peak": peak - before,
            }
        )
    )


def _run_case(dataset: str, impl: str, path: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", dataset, impl, path], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{impl} on {path} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    """Print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument(
        "--original-max-rows", type=int, default=100_000, help="run the original build only up to this many rows"
    )
    parser.add_argument("--tmp", default=None, help="directory for the generated parquet files")
    parser.add_argument("--dataset", choices=("sft", "rl"), default="sft")
    parser.add_argument("--child", nargs=3, metavar=("DATASET", "IMPL", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return

    header = (
        f"{'rows':>9} {'impl':>8} {'tokens':>12} {'build s':>8} {'cpu s':>7} {'rows/s':>9} {'store B/tok':>11} "
        f"{'retained B/tok':>14} {'peak B/tok':>10} {'cpu s/row vs first':>18}"
    )
    print(header)
    print("-" * len(header))
    per_row_first: dict[str, float] = {}
    speedups = []
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for num_rows in args.rows:
            path = os.path.join(tmp, f"{args.dataset}_{num_rows}.parquet")
            (write_parquet if args.dataset == "sft" else write_rl_parquet)(path, num_rows=num_rows)
            results = {}
            for impl in ("original", "compact"):
                if impl == "original" and num_rows > args.original_max_rows:
                    print(f"{num_rows:>9} {impl:>8} {'(skipped: memory)':>30}")
                    continue
                r = results[impl] = _run_case(args.dataset, impl, path)
                per_row = r["cpu"] / r["rows"]
                per_row_first.setdefault(impl, per_row)
                print(
                    f"{r['rows']:>9} {impl:>8} {r['tokens']:>12} {r['seconds']:>8.2f} {r['cpu']:>7.2f} "
                    f"{r['rows'] / r['seconds']:>9.0f} "
                    f"{'-' if r['store'] is None else format(r['store'] / r['tokens'], '.2f'):>11} "
                    f"{r['retained'] / r['tokens']:>14.2f} "
                    f"{r['peak'] / r['tokens']:>10.2f} {per_row / per_row_first[impl]:>18.2f}",
                    flush=True,
                )
            if len(results) == 2:
                speedups.append(
                    (
                        num_rows,
                        results["original"]["cpu"] / results["compact"]["cpu"],
                        results["original"]["peak"] / max(1, results["compact"]["peak"]),
                    )
                )
            os.remove(path)
    for num_rows, time_ratio, peak_ratio in speedups:
        print(f"{num_rows} rows: original/compact build CPU time {time_ratio:.2f}x, peak memory {peak_ratio:.1f}x")
    print(
        "cpu s/row vs first = build CPU seconds per row relative to the same implementation's smallest size "
        "(1.0 = linear); CPU time is the robust figure on a shared machine, wall time (build s) is not"
    )


if __name__ == "__main__":
    main()
