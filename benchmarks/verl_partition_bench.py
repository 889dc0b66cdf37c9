"""The verl drop-in ``get_seqlen_balanced_partitions``: ours vs verl 0.9.1's Karmarkar-Karp, side by side.

    PYTHONPATH=. python benchmarks/verl_partition_bench.py            # full grid (a few minutes)
    PYTHONPATH=. python benchmarks/verl_partition_bench.py --quick    # k=8, equal sizes only

Input: what verl passes, ``calculate_workload(lengths)`` (24576 L + L^2) of heavy-tailed lengths
(lognormal mu 6.5, sigma 0.9, clipped 16..16384), as a Python list (the micro-batch packer) or
a tensor (both trainers' ``_balance_batch``). Per (k, equal_size, input, n): ``ms`` = best of
``reps`` wall-clock runs, ours and verl's interleaved; ``+ms`` = ours - verl (target: <= 1.0);
``imbalance`` = max part load / (total / k) (1.0 is perfect; same input for both);
``imb ratio`` = ours / verl (<= 1: ours balances at least as well).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def lengths_for(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.5, 0.9, n).astype(np.int64), 16, 16384)


def imbalance(parts, loads: np.ndarray) -> float:
    return max(loads[p].sum() for p in parts) / (loads.sum() / len(parts))


def timed(fn, reps: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import verl.utils.seqlen_balancing as verl_sb

    from verl_balance.integrations.verl import get_seqlen_balanced_partitions as ours

    sizes = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    grid = [(8, True)] if args.quick else [(8, True), (8, False), (2, True), (32, True), (32, False)]
    print(
        f"{'k':>3} {'eq':>5} {'input':>6} {'n':>6} | {'ours ms':>8} {'verl ms':>9} {'+ms':>7} | "
        f"{'ours imb':>10} {'verl imb':>10} {'imb ratio':>10}"
    )
    worst_extra, worst_ratio = -float("inf"), 0.0
    for k, equal_size in grid:
        for kind in ("list", "tensor"):
            for n in sizes:
                # verl's Karmarkar-Karp on tensor elements takes seconds beyond ~2k items; free sizes with
                # many parts too: those rows would only show ours far ahead, at minutes of bench time.
                if (kind == "tensor" and n > 2048) or (not equal_size and n * k > 8192 * 8):
                    continue
                workload = verl_sb.calculate_workload(torch.as_tensor(lengths_for(n, args.seed + n)))
                values = workload if kind == "tensor" else workload.tolist()
                loads = workload.numpy().astype(np.float64)
                reps = 15 if n <= 1024 else 5 if n <= 4096 else 1
                ours_ms = verl_ms = float("inf")
                for _ in range(reps):  # interleaved, so load noise hits both alike
                    t, ours_parts = timed(lambda: ours(values, k, equal_size), 1)
                    ours_ms = min(ours_ms, t)
                    t, verl_parts = timed(lambda: verl_sb.get_seqlen_balanced_partitions(values, k, equal_size), 1)
                    verl_ms = min(verl_ms, t)
                ours_imb, verl_imb = imbalance(ours_parts, loads), imbalance(verl_parts, loads)
                worst_extra = max(worst_extra, ours_ms - verl_ms)
                worst_ratio = max(worst_ratio, ours_imb / verl_imb)
                print(
                    f"{k:>3} {str(equal_size):>5} {kind:>6} {n:>6} | {ours_ms:>8.2f} {verl_ms:>9.2f} "
                    f"{ours_ms - verl_ms:>+7.2f} | {ours_imb:>10.6f} {verl_imb:>10.6f} {ours_imb / verl_imb:>10.6f}",
                    flush=True,
                )
    print(f"worst +ms (ours - verl): {worst_extra:+.2f}   worst imbalance ratio (ours / verl): {worst_ratio:.6f}")


if __name__ == "__main__":
    main()
