"""CPU attention, side by side: the two attention paths issue 47 changed, each against what it replaced.

    PYTHONPATH=. python benchmarks/attention_cpu_bench.py [--shape small|qwen2.5-0.5b] [--threads 2] [--iters 20]

- ``train``: forward + backward of packed causal attention over ``--seqs`` sequences
  (``varlen_causal_attention(impl="sdpa_loop")``, the CPU default) against the same loop over
  per-sequence slices ``x[start:end]`` (the previous code, written out here as the baseline): each
  slice's backward scatters into a zero tensor of the whole stream, so its cost grows with
  sequences x stream length; ``split`` has one ``cat`` as its backward.
- ``decode``: one decode step's attention over a left-padded KV cache, HF's ``sdpa`` path
  (``repeat_kv`` of every layer's cache, then SDPA under the mask) against
  ``grouped_sdpa_attention_forward`` (SDPA with ``enable_gqa``: the cache as it is). The CPU rollout
  (``HFRollout``) uses the latter.

Shapes: ``small`` is ``peer_bench.py grpo-trl``'s model (4 query heads, 2 KV heads, head_dim 64;
64 rows of ~110 tokens); ``qwen2.5-0.5b`` is that model's attention (14 query heads, 2 KV heads,
head_dim 64; 64 rows of 512). Timings interleave the two sides per iteration; medians in ms,
ratio = baseline / ours; ``max |diff|`` checks both sides compute the same values.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from verl_balance.models.attention import grouped_sdpa_attention_forward, varlen_causal_attention

SHAPES = {  # query heads, kv heads, head_dim, sequence length
    "small": (4, 2, 64, 110),
    "qwen2.5-0.5b": (14, 2, 64, 512),
}


def _sliced_loop(q, k, v, *, cu_seqlens, scaling):
    """The replaced packed loop: per-sequence slices of the whole stream."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    bounds = cu_seqlens.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        outs.append(
            F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scaling).squeeze(0).transpose(0, 1)
        )
    return torch.cat(outs, dim=0)


def _train_inputs(*, seqs: int, shape: tuple[int, int, int, int], seed: int):
    heads, kv_heads, head_dim, length = shape
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (seqs,), generator=gen)
    cu = torch.zeros(seqs + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    total = int(cu[-1])
    q = torch.randn(total, heads, head_dim, generator=gen, requires_grad=True)
    k = torch.randn(total, kv_heads, head_dim, generator=gen, requires_grad=True)
    v = torch.randn(total, kv_heads, head_dim, generator=gen, requires_grad=True)
    return q, k, v, cu, int(lengths.max())


def _fwd_bwd(fn, q, k, v):
    for x in (q, k, v):
        x.grad = None
    out = fn(q, k, v)
    out.square().mean().backward()
    return out.detach(), q.grad.clone()


def train_section(*, seqs: int, shape, iters: int) -> dict:
    q, k, v, cu, max_len = _train_inputs(seqs=seqs, shape=shape, seed=0)
    scaling = shape[2] ** -0.5
    sides = {
        "sliced (before)": lambda q, k, v: _sliced_loop(q, k, v, cu_seqlens=cu, scaling=scaling),
        "split (ours)": lambda q, k, v: varlen_causal_attention(
            q, k, v, cu_seqlens=cu, max_seqlen=max_len, impl="sdpa_loop"
        ),
    }
    return _compare(sides, lambda fn: _fwd_bwd(fn, q, k, v), iters=iters)


class _Attn(torch.nn.Module):
    is_causal = True


def decode_section(*, rows: int, shape, iters: int) -> dict:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    heads, kv_heads, head_dim, length = shape
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(rows, heads, 1, head_dim, generator=gen)
    k = torch.randn(rows, kv_heads, length, head_dim, generator=gen)
    v = torch.randn(rows, kv_heads, length, head_dim, generator=gen)
    pads = torch.randint(0, length // 2, (rows,), generator=gen)
    mask = (torch.arange(length)[None, :] >= pads[:, None])[:, None, None, :]  # left padding
    module = _Attn()
    module.num_key_value_groups = heads // kv_heads
    sides = {
        "HF sdpa, repeat_kv (before)": lambda: sdpa_attention_forward(module, q, k, v, mask, scaling=head_dim**-0.5)[0],
        "grouped sdpa (ours)": lambda: grouped_sdpa_attention_forward(module, q, k, v, mask, scaling=head_dim**-0.5)[0],
    }
    return _compare(sides, lambda fn: (fn(), None), iters=iters)


def _compare(sides: dict, run, *, iters: int) -> dict:
    times = {name: [] for name in sides}
    results = {}
    for it in range(iters + 2):
        for name, fn in sides.items():
            start = time.perf_counter()
            results[name] = run(fn)
            if it >= 2:  # warm-up
                times[name].append(time.perf_counter() - start)
    (base, ours) = results.values()
    diff = max(float((a - b).abs().max()) for a, b in zip(base, ours) if a is not None)
    return {"ms": {name: 1e3 * statistics.median(t) for name, t in times.items()}, "max_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--seqs", type=int, default=64, help="sequences (train) / rows (decode)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    print(
        f"shape {args.shape} (heads, kv heads, head_dim, length) {shape}; {args.seqs} sequences; threads {args.threads}"
    )
    for section, fn in (("train fwd+bwd", train_section), ("decode step", decode_section)):
        kwargs = {"seqs": args.seqs} if section.startswith("train") else {"rows": args.seqs}
        result = fn(shape=shape, iters=args.iters, **kwargs)
        (base_name, base), (ours_name, ours) = result["ms"].items()
        print(
            f"{section:14s} {base_name} {base:8.2f} ms | {ours_name} {ours:8.2f} ms | "
            f"ratio {base / ours:5.2f}x | max |diff| {result['max_diff']:.1e}"
        )


if __name__ == "__main__":
    main()
