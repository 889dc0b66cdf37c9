"""Balancer benchmark: ours vs the naive contiguous split vs verl 0.9.1, side by side in one run.

    PYTHONPATH=. python benchmarks/balance_bench.py            # full workloads (verl rows if importable)
    PYTHONPATH=. python benchmarks/balance_bench.py --quick    # small smoke run
    --skip-verl-micro skips verl's rearrange_micro_batches on the 4096-sample case (about 1-2 min).

Cases (lengths lognormal, sigma 1, fixed seeds):
  dp_partition   262,144 lengths (median 1000, clipped 16..32768) into 1024 ranks, equal counts;
                 metric: imbalance = max rank tokens / max(total / dp, longest); target <= 1.001, <= 0.2 s.
  micro_batching 4096 lengths (median 1000, clipped 16..16384), token cap 16384, one rank;
                 metric: micro-batches; target <= ceil(total / cap) + 1, <= 0.05 s.
  joint          1024 GRPO-like sequences (prompt 64..512 + response median 700 clipped 16..8192),
                 dp 8, cap 16384; metric: sum_j max_d cost(d, j) / lower bound; target <= 1.001, <= 15 ms.
                 verl's two-stage pipeline = ray_trainer._balance_batch (get_seqlen_balanced_partitions
                 over 24576 L + L^2) + rearrange_micro_batches per rank with the micro-batch count
                 agreed across ranks (what the DP all-reduce MAX does); its time is the sum over ranks.
                 Reported under two cost metrics: tokens, and verl's own workload 24576 L + L^2.
  joint multi-turn  the same on 1024 tool conversations: prompt 400..1200 (system + tool schemas) +
                 1..10 turns (geometric, p 0.35) of model tokens (median 150) and a tool answer
                 (median 200, at most 1024): a few long conversations carry most of the work.
  --only joint   runs the two joint cases alone.
Times are the best of several runs (one run for verl's slow cases).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np

from verl_balance.balance import balanced_partition, plan_balance


class VerlWorkload:
    """verl's calculate_workload: 24576 * L + L^2 (a 7B dense model's FLOPs, up to a constant)."""

    def cost(self, lengths):
        length = np.asarray(lengths, dtype=np.float64)
        return 24576.0 * length + length**2


def lognormal(n, median, seed, lo, hi):
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), 1.0, n)), lo, hi).astype(np.int64)


def grpo_lengths(n, seed):
    rng = np.random.default_rng(seed)
    prompt = rng.integers(64, 513, n)
    response = np.clip(np.round(rng.lognormal(np.log(700), 1.0, n)), 16, 8192).astype(np.int64)
    return prompt + response


def multi_turn_lengths(n, seed):
    """Tool conversations: the prompt plus every turn's model tokens and tool answer."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(400, 1201, n)
    turns = np.minimum(rng.geometric(0.35, n), 10)
    total = prompt.astype(np.int64)
    for i, k in enumerate(turns):
        model = np.clip(np.round(rng.lognormal(np.log(150), 0.8, k)), 4, 2048)
        tool = np.clip(np.round(rng.lognormal(np.log(200), 1.0, k - 1)), 1, 1024)
        total[i] += int(model.sum() + tool.sum())
    return total


def best_time(fn, repeats):
    """(result, best wall seconds, best CPU seconds of this process). numpy here is single-threaded,
    so CPU time is what the wall time would be on an otherwise idle machine."""
    best_wall, best_cpu, out = math.inf, math.inf, None
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        best_cpu = min(best_cpu, time.process_time() - cpu)
        best_wall = min(best_wall, time.perf_counter() - wall)
    return out, (best_wall, best_cpu)


def imbalance(parts, costs, dp):
    lower_bound = max(costs.sum() / dp, costs.max())
    return max(costs[np.asarray(p, dtype=np.int64)].sum() for p in parts) / lower_bound


def sync_ratio(cells, costs, dp):
    """cells[d][j] = index list of rank d's j-th micro-batch (ranks padded to the same count)."""
    num_micro = max(len(r) for r in cells)
    grid = np.zeros((dp, num_micro))
    for d, rank in enumerate(cells):
        for j, mb in enumerate(rank):
            grid[d, j] = costs[np.asarray(mb, dtype=np.int64)].sum()
    return grid.max(axis=0).sum() / max(costs.sum() / dp, costs.max())


def try_import_verl():
    """verl.utils.seqlen_balancing with tensor slicing switched off, so only planning is timed."""
    try:
        from verl.utils import seqlen_balancing
    except Exception as exc:  # noqa: BLE001 - any import failure means "no verl rows"
        print(f"[verl not importable: {type(exc).__name__}: {exc}; verl rows skipped]")
        return None
    seqlen_balancing.tu.index_select_tensor_dict = lambda batch, index: None
    return seqlen_balancing


def verl_batch(lengths):
    """A minimal verl batch for rearrange_micro_batches: jagged input_ids carry the lengths."""
    import torch
    from tensordict import TensorDict

    ids = torch.nested.nested_tensor([torch.zeros(int(n), dtype=torch.long) for n in lengths], layout=torch.jagged)
    return TensorDict({"input_ids": ids}, batch_size=[len(lengths)])


def verl_two_stage(sb, lengths, dp, cap, batch_cache):
    """verl's balance_batch over ranks, then rearrange_micro_batches per rank with a shared count."""
    import torch

    workload = (24576 * torch.as_tensor(lengths) + torch.as_tensor(lengths) ** 2).tolist()
    ranks = sb.get_seqlen_balanced_partitions(workload, k_partitions=dp, equal_size=True)
    batches = [batch_cache(tuple(r)) for r in ranks]
    num_micro = max(math.ceil(lengths[r].sum() / cap) for r in ranks)
    while True:  # the all-reduce MAX of verl's per-rank count, replayed on one process
        cells = []
        for rank, batch in zip(ranks, batches):
            _, idx = sb.rearrange_micro_batches(batch, max_token_len=cap, min_num_micro_batch=num_micro)
            cells.append([[rank[i] for i in mb] for mb in idx])
        agreed = max(len(c) for c in cells)
        if agreed == num_micro:
            return cells
        num_micro = agreed


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--skip-verl-micro", action="store_true", help="skip verl rearrange_micro_batches (4096 case)")
    parser.add_argument("--only", choices=["joint"], help="only the joint DP x micro-batch cases")
    args = parser.parse_args()
    sb = try_import_verl()
    rows = []  # (case, method, metric, value, target, seconds)
    if args.only != "joint":
        partition_and_micro_batching_rows(rows, sb, quick=args.quick, skip_verl_micro=args.skip_verl_micro)
    for name, lengths_fn in (("grpo", grpo_lengths), ("multi-turn", multi_turn_lengths)):
        joint_rows(rows, sb, name=name, lengths=lengths_fn(1024, 0))
    print_table(rows)
    print(f"load average (1, 5, 15 min) after the run: {os.getloadavg()}; cores: {os.cpu_count()}")


def partition_and_micro_batching_rows(rows, sb, *, quick, skip_verl_micro):

    # 1) equal-count DP partition
    n, dp = (16384, 64) if quick else (262144, 1024)
    lengths = lognormal(n, 1000, 0, 16, 32768)
    costs = lengths.astype(np.float64)
    case = f"dp_partition n={n} dp={dp}"
    parts, t = best_time(lambda: balanced_partition(costs=costs, num_parts=dp, equal_size=True), 5)
    rows.append((case, "ours", "imbalance", imbalance(parts, costs, dp), "<=1.001, <=0.2s", t))
    parts, t = best_time(lambda: np.array_split(np.arange(n), dp), 5)
    rows.append((case, "naive", "imbalance", imbalance(parts, costs, dp), "", t))
    if sb is not None:
        parts, t = best_time(lambda: sb.get_seqlen_balanced_partitions(lengths.tolist(), dp, True), 1)
        rows.append((case, "verl", "imbalance", imbalance(parts, costs, dp), "", t))

    # 2) dynamic micro-batching under a token cap, one rank
    n, cap = (1024, 16384) if quick else (4096, 16384)
    lengths = lognormal(n, 1000, 0, 16, 16384)
    bound = math.ceil(lengths.sum() / cap)
    case = f"micro_batching n={n} cap={cap}"
    plan, t = best_time(lambda: plan_balance(seq_lens=lengths, dp_size=1, max_token_len_per_gpu=cap), 5)
    assert max(lengths[mb].sum() for mb in plan.micro_batches[0]) <= cap
    rows.append((case, "ours", "micro-batches", plan.num_micro_batches, f"<={bound + 1} (bound {bound}), <=0.05s", t))
    plan, t = best_time(lambda: plan_balance(seq_lens=lengths, dp_size=1, max_token_len_per_gpu=cap, balance=False), 5)
    rows.append((case, "naive", "micro-batches", plan.num_micro_batches, "", t))
    if sb is not None and not skip_verl_micro:
        batch = verl_batch(lengths)
        (_, idx), t = best_time(lambda: sb.rearrange_micro_batches(batch, max_token_len=cap), 1)
        rows.append((case, "verl", "micro-batches", len(idx), "", t))


def joint_rows(rows, sb, *, name, lengths):
    """3) joint DP x micro-batch plan, synchronised cost, for one length profile."""
    n, dp, cap = len(lengths), 8, 16384
    verl_cells, verl_t = (None, None)
    if sb is not None:
        cache = {}

        def batch_cache(rank):  # building jagged tensors is not part of verl's planning time
            if rank not in cache:
                cache[rank] = verl_batch(lengths[list(rank)])
            return cache[rank]

        verl_two_stage(sb, lengths, dp, cap, batch_cache)  # warm the cache
        verl_cells, verl_t = best_time(lambda: verl_two_stage(sb, lengths, dp, cap, batch_cache), 3)
    for metric_name, workload in (("tokens", None), ("verl-workload", VerlWorkload())):
        case = f"joint {name} n={n} dp={dp} cap={cap} cost={metric_name}"
        metric_costs = lengths.astype(np.float64) if workload is None else workload.cost(lengths)
        kw = dict(seq_lens=lengths, dp_size=dp, max_token_len_per_gpu=cap, workload=workload)
        plan, t = best_time(lambda: plan_balance(**kw), 20)
        quality = sync_ratio(plan.micro_batches, metric_costs, dp)
        rows.append((case, "ours", "sync/bound", quality, "<=1.001, <=15ms", t))
        plan, t = best_time(lambda: plan_balance(**kw, balance=False), 20)
        rows.append((case, "naive", "sync/bound", sync_ratio(plan.micro_batches, metric_costs, dp), "", t))
        if verl_cells is not None:
            rows.append((case, "verl", "sync/bound", sync_ratio(verl_cells, metric_costs, dp), "", verl_t))


def print_table(rows):
    """One table; value and time are also given relative to verl (or naive when verl is absent)."""
    reference = {}
    for case, method, _, value, _, seconds in rows:
        if method == "verl" or (method == "naive" and case not in reference):
            reference[case] = (value, seconds)
    header = ("case", "method", "metric", "value", "target", "wall [s]", "cpu [s]", "value/ref", "cpu/ref", "ref")
    lines = []
    for case, method, metric, value, target, seconds in rows:
        ref_value, ref_time = reference.get(case, (None, None))
        ref_name = "verl" if any(r[0] == case and r[1] == "verl" for r in rows) else "naive"
        value_str = f"{value:.5f}" if isinstance(value, float) else str(value)
        lines.append(
            (
                case,
                method,
                metric,
                value_str,
                target,
                f"{seconds[0]:.4f}",
                f"{seconds[1]:.4f}",
                f"{value / ref_value:.4f}" if ref_value else "",
                f"{seconds[1] / ref_time[1]:.4f}" if ref_time and ref_time[1] > 0 else "",
                ref_name,
            )
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    print(fmt.format(*header))
    print("-+-".join("-" * w for w in widths))
    for line in lines:
        print(fmt.format(*line))


if __name__ == "__main__":
    main()
