"""LoRA vs full fine-tuning on the same HF model (CPU, one process): trainable parameters, AdamW
state bytes and train-step tokens/s, side by side.

    PYTHONPATH=$PWD python benchmarks/lora_bench.py [--hidden 256 --layers 4 --rank 8 --steps 4]

The model is a random qwen2 of the given size (tiny tokenizer from models/tiny_hf.py, nothing is
downloaded). Median step time over ``--steps`` timed steps after one warm-up step; the machine is
shared, so read the ratios.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

import torch

from verl_balance.distributed import ParallelLayout
from verl_balance.engine import EngineConfig, TrainEngine
from verl_balance.engine.config import OptimConfig
from verl_balance.models.hf import HFModelConfig
from verl_balance.models.tiny_hf import write_tiny_model
from verl_balance.testing.multiprocess import run_on_ranks


def write_model(out: str, *, hidden: int, layers: int) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    write_tiny_model(out, family="qwen2")
    config = AutoConfig.from_pretrained(out)
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, 4 * hidden, layers
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 2, hidden // 8
    config.layer_types = [config.layer_types[0]] * layers
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def _measure(rank, *, path, lora_rank, steps, seq_len, batch) -> dict:
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
        engine.train_step([mb])
        if i:
            times.append(time.perf_counter() - start)
    state_bytes = sum(
        t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    return {
        "total": sum(p.numel() for p in engine.model.parameters()),
        "trainable": sum(p.numel() for p in engine.model.parameters() if p.requires_grad),
        "optim_bytes": state_bytes,
        "tokens_per_s": batch * seq_len / statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(tmp, hidden=args.hidden, layers=args.layers)
        kw = {"path": path, "steps": args.steps, "seq_len": args.seq_len, "batch": args.batch}
        full = run_on_ranks(functools.partial(_measure, lora_rank=0, **kw), world=1)[0]
        lora = run_on_ranks(functools.partial(_measure, lora_rank=args.rank, **kw), world=1)[0]
    print(
        f"qwen2 hidden={args.hidden} layers={args.layers}, {full['total']:,} parameters, "
        f"{args.batch}x{args.seq_len} tokens/step, CPU 1 thread"
    )
    print("| mode | trainable params | AdamW state MiB | tokens/s |")
    print("|---|---:|---:|---:|")
    for name, r in [("full", full), (f"LoRA r={args.rank} all-linear", lora)]:
        print(f"| {name} | {r['trainable']:,} | {r['optim_bytes'] / 2**20:.2f} | {r['tokens_per_s']:.0f} |")
    print(
        f"| LoRA / full | {lora['trainable'] / full['trainable']:.4f} | "
        f"{lora['optim_bytes'] / full['optim_bytes']:.4f} | {lora['tokens_per_s'] / full['tokens_per_s']:.2f} |"
    )


if __name__ == "__main__":
    main()
