"""Where the test suite's gloo ranks run: all on one CPU vs spread over every CPU, side by side in one run.

    PYTHONPATH=. python benchmarks/gloo_cpu_placement_bench.py                 # 4 and 2 ranks, 2,000 ops
    PYTHONPATH=. python benchmarks/gloo_cpu_placement_bench.py --ops 500 --ranks 4

The parity tests run 4 gloo ranks (dp*sp = 4) on this 2-core machine; their steps are thousands of
small collectives (a (dp=1, sp=4) parity layout issues about 4,500 per rank). A collective wakes
every rank in turn; here a wake-up on another vCPU costs far more than one on the same vCPU (the
table below), so the figure that matters is per-collective latency and CPU, not
bandwidth. Each row: ``--ops`` all_to_all_single calls of a 256-float tensor, then as many
all_gather_single calls, on fresh ranks either pinned to the first allowed CPU or left to the
scheduler; seconds of wall time and the ranks' CPU seconds (all threads), and the ratio spread/pinned.

What it measured here (2 vCPUs, 2026-12-04, default arguments):

    ranks | pinned wall s  CPU s | spread wall s  CPU s | wall x  CPU x
        4 |          2.70   2.70 |         11.77  15.87 |    4.4    5.9
        2 |          0.74   0.73 |          1.13   1.31 |    1.5    1.8

Pinning the whole test session that way (each pytest-xdist worker and everything it starts on a CPU
of its own) was slower overall: 805 s for the README test command against 617-632 s unpinned. The
parity matrix, whose cells are mostly collectives, got no faster (86 vs 71 s), and the rest of the
suite lost the second core.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.distributed as dist

from verl_balance.distributed.launcher import gloo_group, new_rendezvous, run_on_ranks


def _pin_all_threads(cpus: set[int]) -> None:
    """sched_setaffinity(0) moves only the calling thread; a rank's gloo threads come later, from it."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)


def _collectives(rank: int, *, world: int, ops: int, cpu: int | None, init_method: str) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of ``ops`` all_to_alls and ``ops`` all_gathers."""
    torch.set_num_threads(1)
    if cpu is not None:
        _pin_all_threads({cpu})
    with gloo_group(rank=rank, world_size=world, init_method=init_method):
        send = torch.randn(world * 64)
        received = torch.empty_like(send)
        gathered = torch.empty(world * send.numel())
        dist.barrier()
        wall, cpu_s = time.perf_counter(), time.process_time()
        for _ in range(ops):
            dist.all_to_all_single(received, send)
        for _ in range(ops):
            dist.all_gather_single(gathered, send)
        return time.perf_counter() - wall, time.process_time() - cpu_s


def measure(*, world: int, ops: int, pinned: bool) -> tuple[float, float]:
    """(slowest rank's wall seconds, all ranks' CPU seconds) on fresh rank processes."""
    cpu = min(os.sched_getaffinity(0)) if pinned else None
    fn = functools.partial(_collectives, world=world, ops=ops, cpu=cpu, init_method=new_rendezvous())
    results = run_on_ranks(fn, world=world, init_group=False, fresh=True)
    return max(wall for wall, _ in results), sum(cpu_s for _, cpu_s in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="collectives of each kind per row")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 2], help="gloo world sizes to compare")
    args = parser.parse_args()
    if args.ops < 1 or any(world < 2 for world in args.ranks):
        parser.error("--ops must be >= 1 and every --ranks value >= 2")
    cpus = len(os.sched_getaffinity(0))
    print(f"{cpus} CPUs allowed; {args.ops} all_to_all + {args.ops} all_gather per row")
    print(
        f"{'ranks':>5} | {'pinned wall s':>13} {'CPU s':>6} | {'spread wall s':>13} {'CPU s':>6} |"
        f" {'wall x':>6} {'CPU x':>6}"
    )
    for world in args.ranks:
        pinned_wall, pinned_cpu = measure(world=world, ops=args.ops, pinned=True)
        spread_wall, spread_cpu = measure(world=world, ops=args.ops, pinned=False)
        print(
            f"{world:>5} | {pinned_wall:>13.2f} {pinned_cpu:>6.2f} | {spread_wall:>13.2f} {spread_cpu:>6.2f} |"
            f" {spread_wall / pinned_wall:>6.1f} {spread_cpu / max(pinned_cpu, 1e-9):>6.1f}"
        )


if __name__ == "__main__":
    main()
