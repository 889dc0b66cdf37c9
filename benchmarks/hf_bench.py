"""Packed vs padded forward+backward on one heavy-tailed batch, side by side in one run.

Rows (same batch, same model dimensions, fp32, one table):
- ``hf padded sdpa``: Hugging Face's own model, right-padded (B, L_max) with an attention mask
  (what a padded trainer does); the baseline of the ratio column.
- ``adapter packed (sdpa_masked|sdpa_loop)``: ``HFCausalLM`` on one packed row, no padding.
- ``built-in packed, 3-D sdpa (before)`` / ``4-D sdpa (now)``: the built-in decoder's masked kernel
  with the old 3-D SDPA call (kept here, patched in) and the current 4-D call; ``sdpa_loop``: the
  per-sequence kernel that ``attn_impl=auto`` now picks on CPU.

tokens/s counts real tokens only. Each case runs in a fresh process: peak memory is the growth of
the process's max RSS during the measured steps (CPU) or ``torch.cuda.max_memory_allocated``.

    PYTHONPATH=$PWD python benchmarks/hf_bench.py [--batch 12] [--steps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

DIMS = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "vocab_size": 1024,
}


def heavy_tailed_lengths(batch: int, *, seed: int = 0, cap: int = 1024) -> list[int]:
    """Lognormal lengths (median 96) with one sequence at the cap: the tail a padded batch pays for."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=np.log(96), sigma=0.8, size=batch), 8, cap).astype(int)
    lengths[0] = cap
    return lengths.tolist()


def _masked_sdpa_3d(q, k, v, *, cu_seqlens, scaling, sliding_window):
    """The pre-change kernel: SDPA called with 3-D [H, T, d] tensors (math fallback on CPU)."""
    from verl_balance.models.attention import packed_visibility_mask

    mask = packed_visibility_mask(cu_seqlens, q.shape[0], sliding_window=sliding_window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scaling
    )
    return out.transpose(0, 1)


def _write_model_dir(root: str) -> str:
    from transformers import AutoModelForCausalLM

    from verl_balance.models.tiny_hf import build_config

    config = build_config(
        "llama",
        vocab_size=DIMS["vocab_size"],
        hidden_size=DIMS["hidden_size"],
        intermediate_size=DIMS["intermediate_size"],
        num_layers=DIMS["num_layers"],
        num_heads=DIMS["num_heads"],
        num_kv_heads=DIMS["num_kv_heads"],
        max_position_embeddings=2048,
    )
    config.initializer_range = 0.02
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    return root


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _run_case(case: str, model_dir: str, lengths: list[int], steps: int, threads: int, device: str, queue) -> None:
    torch.set_num_threads(threads)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, DIMS["vocab_size"], (n,), generator=gen) for n in lengths]
    total = sum(lengths)
    if case == "hf padded sdpa":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").to(dev)
        width = max(lengths)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
        ids, mask = ids.to(dev), mask.to(dev)

        def step():
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
            (loss * mask[:, 1:].flatten()).sum().backward()
    else:
        if case.startswith("adapter"):
            from verl_balance.models.hf import HFCausalLM, HFModelConfig

            impl = "sdpa_loop" if "sdpa_loop" in case else "sdpa_masked"
            model = HFCausalLM(HFModelConfig.from_pretrained(model_dir), attn_impl=impl)
        else:
            from verl_balance.models import LlamaForCausalLM, ModelConfig

            if "3-D" in case:
                import verl_balance.models.attention as attention

                attention._masked_sdpa = _masked_sdpa_3d
            impl = "sdpa_loop" if "sdpa_loop" in case else "sdpa_masked"
            model = LlamaForCausalLM(ModelConfig(**DIMS, max_position_embeddings=2048), attn_impl=impl)
        model.to(dev)
        ids = torch.cat(seqs).to(dev)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(dev)
        cu = torch.tensor([0] + np.cumsum(lengths).tolist(), device=dev)
        targets = torch.roll(ids, -1)
        keep = torch.ones(total, device=dev)
        keep[cu[1:] - 1] = 0

        def step():
            logits = model(input_ids=ids, position_ids=positions, cu_seqlens=cu, max_seqlen=max(lengths))
            (F.cross_entropy(logits, targets, reduction="none") * keep).sum().backward()

    model.train()
    step()  # warm-up (allocator, kernels)
    model.zero_grad(set_to_none=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = _peak_rss_bytes()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else _peak_rss_bytes() - base
    queue.put((case, total / statistics.median(times), peak))


CASES = (
    "hf padded sdpa",
    "adapter packed (sdpa_masked)",
    "adapter packed (sdpa_loop)",
    "built-in packed, 3-D sdpa (before)",
    "built-in packed, 4-D sdpa (now)",
    "built-in packed, sdpa_loop (CPU auto)",
)


def main() -> None:
    """Run every case in its own process and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    lengths = heavy_tailed_lengths(args.batch)
    ctx = mp.get_context("spawn")
    results = {}
    with tempfile.TemporaryDirectory() as root:
        model_dir = _write_model_dir(os.path.join(root, "model"))
        for case in CASES:
            queue = ctx.Queue()
            proc = ctx.Process(
                target=_run_case, args=(case, model_dir, lengths, args.steps, args.threads, args.device, queue)
            )
            proc.start()
            results[case] = queue.get()
            proc.join()
    print(
        f"batch: {len(lengths)} sequences, {sum(lengths)} tokens, lengths min/median/max "
        f"{min(lengths)}/{int(np.median(lengths))}/{max(lengths)}, padded to {len(lengths) * max(lengths)} tokens; "
        f"model {DIMS}; device {args.device}, {args.threads} thread(s), median of {args.steps} steps"
    )
    base_tps, base_mem = results[CASES[0]][1], results[CASES[0]][2]
    print(f"{'case':38s} {'tokens/s':>10s} {'vs padded':>10s} {'peak MiB':>9s} {'mem vs padded':>14s}")
    for case in CASES:
        _, tps, peak = results[case]
        print(f"{case:38s} {tps:10.0f} {tps / base_tps:10.2f} {peak / 2**20:9.1f} {peak / max(base_mem, 1):14.2f}")
    old, new = results[CASES[3]][1], results[CASES[4]][1]
    print(f"built-in 4-D / 3-D SDPA speed-up: {new / old:.2f}x")


if __name__ == "__main__":
    main()
