"""The verl drop-in ``get_seqlen_balanced_partitions``: ours vs verl 0.9.1's Karmarkar-Karp, side by side.

    PYTHONPATH=. python benchmarks/verl_partition_bench.py                  # full grid (~10 minutes)
    PYTHONPATH=. python benchmarks/verl_partition_bench.py --quick          # k=8, n <= 1024
    PYTHONPATH=. python benchmarks/verl_partition_bench.py --sizes 64 --ks 8 --workloads heavy --equal on
    PYTHONPATH=. python benchmarks/verl_partition_bench.py --input tensor --sizes 64 256 1024  # trainers' input

Input: what verl passes, ``calculate_workload(lengths)`` (24576 L + L^2, the 7B-style FLOPs
proxy) as a Python list (``--input tensor``: the int64 tensor both trainers pass), for two length
profiles: ``heavy`` (lognormal mu 6.5, sigma 0.9, clipped 16..16384: a few samples carry most of
the work) and ``equal`` (every sample 1024 tokens). Per (workload, k, equal_size, n):
``ours ms`` / ``verl ms`` = best of N wall-clock runs, ours and verl's interleaved (and
alternating which goes first) so that load noise hits both alike; ``diff ms`` = ours - verl
(target: <= +1.0); ``imbalance`` = max part / a lower bound on the optimal max part (mean, largest
item, pigeonhole bounds; 1.0 = provably optimal), same input for both; ``ok`` = our max part <=
verl's, compared exactly (integer sums).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def lengths_for(workload: str, n: int, seed: int) -> np.ndarray:
    if workload == "equal":
        return np.full(n, 1024, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.5, 0.9, n).astype(np.int64), 16, 16384)


def max_part(parts, loads: list[int]) -> int:
    return max(sum(loads[i] for i in part) for part in parts)


def repeats_for(n: int, verl_free: bool) -> int:
    if n <= 1024:
        return 21 if not verl_free or n <= 256 else 7
    if n <= 4096:
        return 5 if not verl_free else 2
    return 2 if not verl_free else 1


def bench_row(ours, verl_fn, values, k: int, equal_size: bool, reps: int):
    ours_ms = verl_ms = float("inf")
    for rep in range(reps):  # interleaved, alternating order, so load noise hits both alike
        for which in (0, 1) if rep % 2 == 0 else (1, 0):
            fn = ours if which == 0 else verl_fn
            start = time.perf_counter()
            parts = fn(values, k, equal_size)
            elapsed = (time.perf_counter() - start) * 1e3
            if which == 0:
                ours_ms, ours_parts = min(ours_ms, elapsed), parts
            else:
                verl_ms, verl_parts = min(verl_ms, elapsed), parts
    return ours_ms, verl_ms, ours_parts, verl_parts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="k=8, n <= 1024")
    parser.add_argument("--sizes", type=int, nargs="*", default=[64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--ks", type=int, nargs="*", default=[2, 4, 8, 16])
    parser.add_argument("--workloads", nargs="*", default=["heavy", "equal"], choices=["heavy", "equal"])
    parser.add_argument("--equal", nargs="*", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--input", default="list", choices=["list", "tensor"], help="tensor: what both trainers pass")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import verl.utils.seqlen_balancing as verl_sb

    from verl_balance.integrations.verl import get_seqlen_balanced_partitions as ours
    from verl_balance.integrations.verl.patches.seqlen import _lower_bound

    sizes = [n for n in args.sizes if n <= 1024] if args.quick else args.sizes
    ks = [8] if args.quick else args.ks
    print(
        f"{'workload':>8} {'k':>3} {'equal':>5} {'n':>6} | {'ours ms':>8} {'verl ms':>9} {'diff ms':>8} | "
        f"{'ours imb':>9} {'verl imb':>9} {'ok':>3}"
    )
    worst_diff, all_ok = -float("inf"), True
    for workload in args.workloads:
        for equal_size in [flag == "on" for flag in args.equal]:
            for k in ks:
                for n in sizes:
                    lengths = lengths_for(workload, n, args.seed + n)
                    workload_tensor = verl_sb.calculate_workload(torch.as_tensor(lengths))
                    values = workload_tensor.tolist()
                    given = workload_tensor if args.input == "tensor" else values
                    reps = repeats_for(n, verl_free=not equal_size)
                    ours_ms, verl_ms, ours_parts, verl_parts = bench_row(
                        ours, verl_sb.get_seqlen_balanced_partitions, given, k, equal_size, reps
                    )
                    bound = _lower_bound(np.asarray(values, dtype=np.float64), k, equal_size=equal_size)
                    ours_max, verl_max = max_part(ours_parts, values), max_part(verl_parts, values)
                    ok = ours_max <= verl_max
                    worst_diff, all_ok = max(worst_diff, ours_ms - verl_ms), all_ok and ok
                    print(
                        f"{workload:>8} {k:>3} {'on' if equal_size else 'off':>5} {n:>6} | {ours_ms:>8.2f} "
                        f"{verl_ms:>9.2f} {ours_ms - verl_ms:>+8.2f} | {ours_max / bound:>9.5f} "
                        f"{verl_max / bound:>9.5f} {'yes' if ok else 'NO':>3}",
                        flush=True,
                    )
    print(f"worst diff ms (ours - verl): {worst_diff:+.2f}   ours max part <= verl's in every row: {all_ok}")


if __name__ == "__main__":
    main()
