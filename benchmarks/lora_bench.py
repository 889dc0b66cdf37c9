"""LoRA vs full fine-tuning on the same HF model (CPU, one process per mode): trainable parameters,
AdamW state bytes, peak RSS, engine checkpoint size and train-step tokens/s, side by side.

    PYTHONPATH=$PWD python benchmarks/lora_bench.py [--hidden 256 --layers 4 --ranks 8,16 --steps 4]
    PYTHONPATH=$PWD python benchmarks/lora_bench.py --shape qwen2.5-0.5b --ranks 8,16 --steps 1 \
        --seq-len 32 --batch 2

The model is a random qwen2 of the given size (tiny tokenizer from models/tiny_hf.py, nothing is
downloaded); ``--shape qwen2.5-0.5b`` uses Qwen2.5-0.5B's dimensions (hidden 896, 24 layers, 14
heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings). Each mode runs in a fresh
process (its peak RSS is its own). Median step time over ``--steps`` timed steps after one warm-up
step; the machine is shared, so read the ratios. The checkpoint is TrainEngine.save_checkpoint
(DCP of the model + AdamW state, engine state).
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import tempfile
import time

import torch

from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.engine import EngineConfig, TrainEngine
from verl_balance.engine.config import OptimConfig
from verl_balance.models.hf import HFModelConfig
from verl_balance.models.tiny_hf import write_tiny_model

# Qwen2.5-0.5B's dimensions (config.json of Qwen/Qwen2.5-0.5B).
SHAPES = {
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
}


def write_model(out: str, *, hidden: int, layers: int, shape: str | None = None) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    write_tiny_model(out, family="qwen2")
    config = AutoConfig.from_pretrained(out)
    if shape is None:
        dims = {"hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers}
        dims.update(num_attention_heads=8, num_key_value_heads=2)
    else:
        dims = dict(SHAPES[shape])
    for key, value in dims.items():
        setattr(config, key, value)
    config.head_dim = config.hidden_size // config.num_attention_heads
    config.layer_types = [config.layer_types[0]] * config.num_hidden_layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _measure(rank, *, path, lora_rank, steps, seq_len, batch, checkpoint_dir) -> dict:
    torch.set_num_threads(1)
    config = HFModelConfig.from_pretrained(path)
    engine = TrainEngine(
        model_config=config,
        engine_config=EngineConfig(seed=0, lora_rank=lora_rank, lora_alpha=2 * max(lora_rank, 1), optim=OptimConfig()),
        layout=ParallelLayout(dp=1, sp=1, device_type="cpu"),
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 300, (batch, seq_len), generator=gen)
    mb = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(batch, seq_len)}
    times = []
    for i in range(steps + 1):
        start = time.perf_counter()
        engine.train_batch([mb])
        if i:
            times.append(time.perf_counter() - start)
    state_bytes = sum(
        t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before the checkpoint save
    ckpt = os.path.join(checkpoint_dir, f"r{lora_rank}")
    engine.save_checkpoint(ckpt, step=engine.global_step)
    return {
        "peak_rss": peak_rss,
        "checkpoint_bytes": _dir_bytes(ckpt),
        "total": sum(p.numel() for p in engine.model.parameters()),
        "trainable": sum(p.numel() for p in engine.model.parameters() if p.requires_grad),
        "optim_bytes": state_bytes,
        "tokens_per_s": batch * seq_len / statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="a real model's dimensions")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", default="8", help="comma-separated LoRA ranks (all-linear targets)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(os.path.join(tmp, "model"), hidden=args.hidden, layers=args.layers, shape=args.shape)
        kw = {"path": path, "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch, "checkpoint_dir": tmp}
        rows = {}
        for rank in [0, *ranks]:
            rows[rank] = run_on_ranks(functools.partial(_measure, lora_rank=rank, **kw), world=1)[0]
            print(f"measured lora_rank={rank}: {rows[rank]}", flush=True)
    full = rows[0]
    name = args.shape or f"qwen2 hidden={args.hidden} layers={args.layers}"
    print(f"{name}, {full['total']:,} parameters, {args.batch}x{args.seq_len} tokens/step, CPU 1 thread, fp32")
    print("| mode | trainable params | AdamW state MiB | peak RSS MiB | checkpoint MiB | tokens/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for rank, r in rows.items():
        label = "full" if rank == 0 else f"LoRA r={rank} all-linear"
        print(
            f"| {label} | {r['trainable']:,} | {r['optim_bytes'] / 2**20:.2f} | {r['peak_rss'] / 2**20:.0f} | "
            f"{r['checkpoint_bytes'] / 2**20:.1f} | {r['tokens_per_s']:.1f} |"
        )
    for rank in ranks:
        r = rows[rank]
        print(
            f"| LoRA r={rank} / full | {r['trainable'] / full['trainable']:.4f} | "
            f"{r['optim_bytes'] / full['optim_bytes']:.4f} | {r['peak_rss'] / full['peak_rss']:.2f} | "
            f"{r['checkpoint_bytes'] / full['checkpoint_bytes']:.3f} | {r['tokens_per_s'] / full['tokens_per_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
