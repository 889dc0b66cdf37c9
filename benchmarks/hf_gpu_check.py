"""One prepared accelerator check of the HF adapter: bf16 on CUDA vs the fp32 CPU loss, tokens/s.

    PYTHONPATH=$PWD python benchmarks/hf_gpu_check.py [--model-path DIR] [--device cuda] [--steps 10]

Without --model-path a tiny random qwen2 is written to a temporary directory. The same packed
heavy-tailed batch is run (a) in fp32 on CPU (reference loss, sdpa_masked) and (b) on --device with
bf16 weights through each available kernel (flash_attn varlen if installed,
sdpa_loop, sdpa_masked); the table gives the loss, its relative difference to the fp32 reference,
forward+backward tokens/s and peak memory. Expect rel. diff ~1e-2 in bf16 (rounding), not 1e-5.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from verl_balance.models.attention import _flash_attn_varlen
from verl_balance.models.hf import HFCausalLM, HFModelConfig


def _batch(vocab_size: int, *, num: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(256), 0.8, size=num), 16, 4096).astype(int).tolist()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (sum(lengths),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0] + np.cumsum(lengths).tolist())
    keep = torch.ones(len(ids))
    keep[cu[1:] - 1] = 0
    return ids, positions, cu, max(lengths), keep


def _loss(model, batch, device):
    ids, positions, cu, max_len, keep = (x.to(device) if torch.is_tensor(x) else x for x in batch)
    logits = model(input_ids=ids, position_ids=positions, cu_seqlens=cu, max_seqlen=max_len)
    per_token = F.cross_entropy(logits.float(), torch.roll(ids, -1), reduction="none")
    return (per_token * keep).sum() / keep.sum()


def main() -> None:
    """Print one table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    path = args.model_path
    if path is None:
        from verl_balance.models.tiny_hf import write_tiny_model

        path = write_tiny_model(tempfile.mkdtemp(prefix="hf_gpu_check_") + "/m", family="qwen2", initializer_range=0.02)
    config = HFModelConfig.from_pretrained(path)
    batch = _batch(config.vocab_size, num=args.sequences)
    tokens = int(batch[4].numel())
    reference = HFCausalLM(config, attn_impl="sdpa_masked" if tokens <= 8192 else "sdpa_loop")
    with torch.no_grad():
        ref_loss = float(_loss(reference, batch, torch.device("cpu")))
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    impls = (["flash_attn"] if device.type == "cuda" and _flash_attn_varlen() else []) + ["sdpa_loop", "sdpa_masked"]
    print(
        f"model {config.model_type} at {path}: {config.num_layers} layers, hidden {config.hidden_size}; "
        f"{args.sequences} sequences, {tokens} tokens; fp32 CPU reference loss {ref_loss:.6f}"
    )
    print(f"{'kernel':12s} {'dtype':9s} {'loss':>10s} {'rel diff':>9s} {'tokens/s':>10s} {'peak GiB':>9s}")
    for impl in impls:
        model = HFCausalLM(config, attn_impl=impl).to(device=device, dtype=dtype)
        model.train()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            loss = float(_loss(model, batch, device))  # also the warm-up
        times = []
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            _loss(model, batch, device).backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        print(
            f"{impl:12s} {str(dtype).split('.')[-1]:9s} {loss:10.6f} {abs(loss - ref_loss) / abs(ref_loss):9.1e} "
            f"{tokens / float(np.median(times)):10.0f} {peak:9.2f}"
        )


if __name__ == "__main__":
    main()
