"""GPU check (run by hand on a CUDA machine; not collected by pytest).

    PYTHONPATH=. python tests/engine/gpu_check.py [--seq-len 1024 --samples 16 --steps 5]

1. The single-rank engine on CUDA with bf16 params and the fastest attention available gives
   the CPU fp32 reference loss (verl_balance.parity.reference_steps) to bf16 tolerance.
2. Training throughput of the "tiny" and "100m" presets for each FSDP2 gradient-accumulation
   setting (per-micro-batch sync, deferred sync, deferred + unsharded step): the engine's own
   perf/tokens_per_s_per_device, perf/mfu and perf/max_memory_allocated_gb (medians over steps),
   next to tokens/s timed by this script around the steps.
On a CPU-only machine it runs both parts on CPU with small sizes (a smoke test of the script).
Micro-batches stay on the CPU, as Ray delivers them to a worker: the engine packs on the host.
"""

import argparse
import os
import statistics
import time

import torch

from verl_balance.distributed import ParallelLayout, init_distributed
from verl_balance.engine import EngineConfig, TrainEngine
from verl_balance.engine.config import FSDPConfig, OptimConfig
from verl_balance.models import ModelConfig
from verl_balance.parity import ParitySettings, make_global_batch, reference_steps


def random_batch(*, vocab: int, samples: int, seq_len: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (samples,), generator=gen)
    pos = torch.arange(seq_len)[None, :]
    mask = (pos < lengths[:, None]).long()
    return {
        "input_ids": torch.randint(0, vocab, (samples, seq_len), generator=gen) * mask,
        "attention_mask": mask,
        "loss_mask": mask.float(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda:
        args.seq_len, args.samples, args.steps = 64, 4, 1
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    init_distributed()
    layout = ParallelLayout(dp=1, sp=1)
    dtype = "bfloat16" if cuda else "float32"

    settings = ParitySettings()
    ref = reference_steps(settings, agg_modes=["token-mean"])["token-mean"]["loss"]
    engine = TrainEngine(
        model_config=settings.model,
        layout=layout,
        engine_config=EngineConfig(
            **{**settings.engine_config(agg_mode="token-mean").__dict__, "param_dtype": dtype, "attn_impl": "auto"}
        ),
    )
    batch = make_global_batch(settings)
    got = engine.eval_loss([batch])["loss"]
    rel = abs(got - ref) / ref
    print(
        f"device={layout.device} param_dtype={dtype} loss={got:.6f} cpu_fp32_ref={ref:.6f} "
        f"rel={rel:.2e} {'PASS' if rel < 2e-2 else 'FAIL'}"
    )

    variants = {
        "per-micro-batch": FSDPConfig(),
        "deferred": FSDPConfig(defer_gradient_sync=True),
        "deferred+unsharded": FSDPConfig(
            defer_gradient_sync=True, reshard_after_forward=False, reshard_after_backward=False
        ),
    }
    print(
        f"{'preset':>6} {'params':>8} {'fsdp':>18} {'tokens/step':>11} {'tokens/s':>10} "
        f"{'engine tok/s':>12} {'mfu':>6} {'max alloc GB':>12}"
    )
    for preset in ("tiny", "100m"):
        cfg = ModelConfig.preset(preset)
        data = random_batch(vocab=cfg.vocab_size, samples=args.samples, seq_len=args.seq_len, seed=0)
        mbs = [
            {k: v[i : i + args.micro_batch] for k, v in data.items()} for i in range(0, args.samples, args.micro_batch)
        ]
        tokens = int(data["attention_mask"].sum())
        for name, fsdp in variants.items():
            engine = TrainEngine(
                model_config=cfg,
                layout=layout,
                engine_config=EngineConfig(optim=OptimConfig(lr=1e-4), param_dtype=dtype, fsdp=fsdp),
            )
            engine.train_batch(mbs)  # warm-up (allocations, kernels)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            steps = [engine.train_batch(mbs) for _ in range(args.steps)]
            if cuda:
                torch.cuda.synchronize()
            rate = tokens * args.steps / (time.perf_counter() - start)
            params = sum(p.numel() for p in engine.model.parameters())
            mfu = [m["perf/mfu"] for m in steps if "perf/mfu" in m]
            mem = max((m.get("perf/max_memory_allocated_gb", 0.0) for m in steps), default=0.0)
            engine_rate = statistics.median(m["perf/tokens_per_s_per_device"] for m in steps)
            print(
                f"{preset:>6} {params / 1e6:>7.2f}M {name:>18} {tokens:>11} {rate:>10.0f} {engine_rate:>12.0f} "
                f"{(f'{statistics.median(mfu):.3f}' if mfu else 'n/a'):>6} {mem:>12.2f}"
            )
            del engine
            if cuda:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
