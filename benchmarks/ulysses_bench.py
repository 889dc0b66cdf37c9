"""Ulysses q/k/v exchange: three all-to-alls (one per tensor) vs one for the three together
(``all_to_all_seq_to_head_together``, what ``models/attention.py`` uses), forward and backward, side
by side in one run on gloo ranks of this machine.

    PYTHONPATH=. python benchmarks/ulysses_bench.py              # both shapes, 30 rounds each
    PYTHONPATH=. python benchmarks/ulysses_bench.py --rounds 10

Shapes (one attention layer's q, k, v for ``--tokens`` packed tokens of one SP group):

- Qwen2.5-0.5B: 14 query heads, 2 kv heads, head_dim 64, sp = 2 (14 heads split 2 ways);
- a 72B-like layer (Qwen2.5-72B): 64 query heads, 8 kv heads, head_dim 128, sp = 4.

Rounds alternate (separate, together, separate, ...); each figure is the median seconds of one
layer's exchange, forward + backward, on rank 0. Both ways must give the same tensors and gradients
(checked every run). On 2 CPU cores with gloo the saving is mostly per-collective latency; on NCCL it
is two fewer kernel launches and synchronisations per layer each way.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist

from verl_balance.distributed import all_to_all_seq_to_head, all_to_all_seq_to_head_together
from verl_balance.distributed.launcher import run_on_ranks

SHAPES = {"qwen2.5-0.5b sp2": (14, 2, 64, 2), "72b-like sp4": (64, 8, 128, 4)}


def _exchange(q, k, v, *, together: bool):
    """One layer's exchange, forward and backward; (seconds, outputs, input gradients)."""
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    dist.barrier()
    start = time.perf_counter()
    if together:
        outs = all_to_all_seq_to_head_together(q, k, v, group=dist.group.WORLD)
    else:
        outs = tuple(all_to_all_seq_to_head(t, group=dist.group.WORLD) for t in (q, k, v))
    sum(o.square().sum() for o in outs).backward()
    seconds = time.perf_counter() - start
    return seconds, [o.detach() for o in outs], [t.grad for t in (q, k, v)]


def _rank(rank: int, *, heads: int, kv_heads: int, head_dim: int, tokens: int, rounds: int) -> dict:
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(rank)
    local = tokens // world
    q = torch.randn(local, heads, head_dim, generator=gen)
    k, v = (torch.randn(local, kv_heads, head_dim, generator=gen) for _ in range(2))
    times = {False: [], True: []}
    for round_index in range(rounds):
        for together in (False, True) if round_index % 2 == 0 else (True, False):
            times[together].append(_exchange(q, k, v, together=together)[0])
    _, outs_a, grads_a = _exchange(q, k, v, together=False)
    _, outs_b, grads_b = _exchange(q, k, v, together=True)
    same = all(torch.equal(a, b) for a, b in zip(outs_a + grads_a, outs_b + grads_b, strict=True))
    return {"separate": statistics.median(times[False]), "together": statistics.median(times[True]), "same": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="packed tokens of the SP group")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    print(f"{'shape':<18} {'separate ms':>12} {'together ms':>12} {'ratio':>6} same")
    for name, (heads, kv_heads, head_dim, sp) in SHAPES.items():
        task = functools.partial(
            _rank, heads=heads, kv_heads=kv_heads, head_dim=head_dim, tokens=args.tokens, rounds=args.rounds
        )
        result = run_on_ranks(task, world=sp)[0]
        ratio = result["separate"] / result["together"]
        print(
            f"{name:<18} {1e3 * result['separate']:>12.2f} {1e3 * result['together']:>12.2f} "
            f"{ratio:>6.2f} {result['same']}"
        )


if __name__ == "__main__":
    main()
