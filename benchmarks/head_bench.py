"""Output head: peak memory and speed of log-prob + entropy + backward, unchunked vs chunked.

The head computes, from final hidden states [T, H] and the output weight [V, H], the per-token
log-prob of the target and the entropy (verl's PPO actor with entropy), then back-propagates a
generic per-token objective into hidden and weight. "unchunked" materializes the [T, V] fp32 logits
(``logits_chunk_size=0``, the reference path); "chunked" is models/output_head.py's
``chunked_token_log_probs`` (``logits_chunk_size`` tokens at a time, logits recomputed in backward).

Each configuration runs in its own subprocess: its peak is the process's ``ru_maxrss`` after the
head minus its ``ru_maxrss`` after building the inputs (torch's CPU allocations are invisible to
tracemalloc), so one configuration never inherits another's high-water mark. On CUDA the peak is
``torch.cuda.max_memory_allocated`` above the inputs. The weight's gradient (V x H fp32) is part
of both peaks. Default sizes are Qwen2.5-0.5B's head (vocab 151,936, hidden 896); the unchunked path
at 8,192 tokens needs ~15-20 GB, so by default it stops at 4,096 tokens.

    python benchmarks/head_bench.py                       # the default table
    python benchmarks/head_bench.py --unchunked 1024 --chunked 1024,4096 --chunk 512
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run_one(*, tokens: int, vocab: int, hidden: int, chunk: int, device: str, threads: int) -> dict:
    """One head forward + backward in this process; its peak memory above the inputs and time."""
    import torch

    from verl_balance.models.output_head import LogitTransform, head_token_log_probs

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    dev = torch.device(device)
    hidden_states = (torch.randn(tokens, hidden, device=dev) * 0.5).requires_grad_()
    weight = (torch.randn(vocab, hidden, device=dev) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=dev)
    upstream = torch.randn(2, tokens, device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_peak_bytes()
    start = time.perf_counter()
    log_probs, entropy = head_token_log_probs(
        hidden_states, weight, targets, transform=LogitTransform(), with_entropy=True, chunk_size=chunk
    )
    ((upstream[0] * log_probs).sum() + (upstream[1] * entropy).sum()).backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else _rss_peak_bytes()
    return {"tokens": tokens, "chunk": chunk, "peak_bytes": peak - base, "seconds": seconds}


def _in_subprocess(args: argparse.Namespace, *, tokens: int, chunk: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        f"--tokens={tokens}",
        f"--chunk-size={chunk}",
        f"--vocab={args.vocab}",
        f"--hidden={args.hidden}",
        f"--device={args.device}",
        f"--threads={args.threads}",
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _table(rows: list[dict]) -> str:
    lines = [
        f"{'head':>9} {'tokens':>7} {'chunk':>6} {'peak MB':>9} {'seconds':>8} {'tokens/s':>9}",
        "-" * 53,
    ]
    for r in rows:
        name = "chunked" if r["chunk"] else "unchunked"
        lines.append(
            f"{name:>9} {r['tokens']:>7} {r['chunk'] or '-':>6} {r['peak_bytes'] / 2**20:>9.0f} "
            f"{r['seconds']:>8.2f} {r['tokens'] / r['seconds']:>9.0f}"
        )
    unchunked = {r["tokens"]: r for r in rows if not r["chunk"]}
    chunked = {r["tokens"]: r for r in rows if r["chunk"]}
    common = sorted(set(unchunked) & set(chunked))
    if common:
        lines += ["", f"{'tokens':>7} {'peak unchunked / chunked':>25} {'tokens/s chunked / unchunked':>29}"]
        for t in common:
            u, c = unchunked[t], chunked[t]
            lines.append(
                f"{t:>7} {u['peak_bytes'] / max(c['peak_bytes'], 1):>25.2f} {u['seconds'] / c['seconds']:>29.2f}"
            )
    return "\n".join(lines)


def _tokens(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--chunk", type=int, default=1024, help="logits_chunk_size of the chunked head")
    parser.add_argument("--unchunked", type=_tokens, default=[1024, 2048, 4096], help="token counts, unchunked")
    parser.add_argument("--chunked", type=_tokens, default=[1024, 2048, 4096, 8192], help="token counts, chunked")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--chunk-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = run_one(
            tokens=args.tokens,
            vocab=args.vocab,
            hidden=args.hidden,
            chunk=args.chunk_size,
            device=args.device,
            threads=args.threads,
        )
        print(json.dumps(result))
        return
    print(f"vocab {args.vocab}, hidden {args.hidden}, fp32, device {args.device}, log-prob + entropy + backward")
    rows = []
    for chunk, counts in ((0, args.unchunked), (args.chunk, args.chunked)):
        for tokens in counts:
            rows.append(_in_subprocess(args, tokens=tokens, chunk=chunk))
            print(json.dumps(rows[-1]), flush=True)
    print(_table(rows))


if __name__ == "__main__":
    main()
