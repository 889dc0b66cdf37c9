"""Check the memory model (verl_balance/memory.py) against one measured SFT step on CPU.

    PYTHONPATH=. python benchmarks/memory_model_check.py            # all cases (~1-2 minutes)
    PYTHONPATH=. python benchmarks/memory_model_check.py --tokens 2048 --cases small-dp1-fp32

Each case runs TrainEngine.train_batch on 1 or 2 gloo ranks (run_on_ranks) on a small model: the
built-in preset "small" (no activation checkpointing) or a random Hugging Face Llama of the same
dimensions written here (activation checkpointing on/off). Step 1 warms up (AdamW allocates its
state); step 2 is measured. Printed per case, rank 0, predicted vs measured and their ratio:

- params / grads / optimizer: bytes of the live local tensors (grads captured just before the
  optimizer step). These are exact (tests/test_memory.py asserts equality).
- step peak: peak RSS growth of the process during step 2 over its RSS just before it (VmHWM after
  resetting it; "sampled": a psutil thread every 1 ms) vs the model's step_transient (unsharded
  params + unsharded grads in flight + activations + head) plus the sharded gradients (the engine
  drops them after every step: zero_grad(set_to_none=True)). This is approximate: the CPU attention
  kernel, gradients of activations and optimizer temporaries are not in the model. The ranks run
  with MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns every freed tensor to the OS and RSS
  follows the live tensors (with its default dynamic threshold, memory freed in step 1 stays
  mapped and step 2's growth reads ~25% low).

Start-up memory is not compared: until sharded loading lands, every rank builds the full fp32 model
first (the model's startup_full).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile

MiB = 1024**2
SMALL = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8, num_kv_heads=4)
CASES = {
    # name: (model kind, dp, param_dtype, activation checkpointing)
    "small-dp1-fp32": ("preset:small", 1, "float32", False),
    "small-dp2-fp32": ("preset:small", 2, "float32", False),
    "small-dp2-bf16": ("preset:small", 2, "bfloat16", False),
    "hf-dp1-fp32": ("hf", 1, "float32", False),
    "hf-dp1-fp32-ac": ("hf", 1, "float32", True),
}


def write_hf_llama(out: str) -> str:
    """A random HF Llama with the "small" preset's dimensions (config.json + safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_balance.models.tiny_hf import build_config

    config = build_config(
        "llama",
        vocab_size=SMALL["vocab_size"],
        hidden_size=SMALL["hidden_size"],
        intermediate_size=SMALL["intermediate_size"],
        num_layers=SMALL["num_layers"],
        num_heads=SMALL["num_heads"],
        num_kv_heads=SMALL["num_kv_heads"],
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def _micro_batch(*, tokens: int, seq_len: int, vocab: int, seed: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (tokens // seq_len, seq_len), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones(ids.shape)}


def measure_rank(rank: int, *, model: str, dp: int, param_dtype: str, ac: bool, tokens: int, seq_len: int) -> dict:
    """Two train steps on this rank; exact state bytes and the peak RSS growth of the second."""
    from verl_balance.distributed import ParallelLayout
    from verl_balance.engine import EngineConfig, TrainEngine
    from verl_balance.models import ModelConfig
    from verl_balance.models.hf import HFModelConfig
    from verl_balance.testing.memory_probe import PeakRSS, local_state_bytes

    if model.startswith("preset:"):
        model_config = ModelConfig.preset(model.split(":", 1)[1])
    else:
        model_config = HFModelConfig.from_pretrained(model, enable_gradient_checkpointing=ac)
    engine = TrainEngine(
        model_config=model_config,
        engine_config=EngineConfig(param_dtype=param_dtype, attn_impl="sdpa_loop"),
        layout=ParallelLayout(dp=dp, sp=1, device_type="cpu"),
    )
    captured = {}
    step = engine.optimizer_step

    def capture_then_step():
        captured.update(local_state_bytes(engine.model, engine.optimizer))
        return step()

    engine.optimizer_step = capture_then_step
    batch = [_micro_batch(tokens=tokens, seq_len=seq_len, vocab=SMALL["vocab_size"], seed=rank)]
    engine.train_batch(batch)  # warm-up: AdamW state, allocator pools
    probe = PeakRSS()
    with probe.measure():
        engine.train_batch(batch)
    state = local_state_bytes(engine.model, engine.optimizer)
    growth = probe.hwm_growth if probe.hwm_growth is not None else probe.sampled_growth
    return {**state, "grads": captured["grads"], "step_peak": growth, "sampled_peak": probe.sampled_growth}


def run_case(name: str, *, tokens: int, seq_len: int, hf_dir: str) -> list[tuple[str, int, int]]:
    from verl_balance.distributed.launcher import run_on_ranks
    from verl_balance.memory import MemoryLayout, estimate, load_shapes

    kind, dp, param_dtype, ac = CASES[name]
    model = hf_dir if kind == "hf" else kind
    fn = functools.partial(
        measure_rank, model=model, dp=dp, param_dtype=param_dtype, ac=ac, tokens=tokens, seq_len=seq_len
    )
    measured = run_on_ranks(fn, world=dp)[0]
    layout = MemoryLayout(dp=dp, param_dtype=param_dtype, tokens=tokens, activation_checkpointing=ac)
    est = estimate(load_shapes(model), layout)
    predicted_step = est.step_transient + est.grads
    return [
        ("params", est.params, measured["params"]),
        ("grads", est.grads, measured["grads"]),
        ("optimizer", est.optimizer, measured["optimizer"]),
        ("step peak", predicted_step, measured["step_peak"]),
        ("  (sampled)", predicted_step, measured["sampled_peak"]),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="micro-batch tokens per rank")
    parser.add_argument("--seq-len", type=int, default=256, help="length of every packed sequence")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the spawned ranks' glibc
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = write_hf_llama(os.path.join(tmp, "llama")) if any(CASES[c][0] == "hf" for c in args.cases) else ""
        print(f"tokens/rank={args.tokens} (sequences of {args.seq_len}), rank 0, MiB", flush=True)
        print(f"{'case':<18}{'component':<14}{'predicted':>12}{'measured':>12}{'meas/pred':>11}")
        for case in args.cases:
            for component, pred, meas in run_case(case, tokens=args.tokens, seq_len=args.seq_len, hf_dir=hf_dir):
                ratio = meas / pred if pred else float("nan")
                print(f"{case:<18}{component:<14}{pred / MiB:>12.2f}{meas / MiB:>12.2f}{ratio:>11.3f}", flush=True)
                rows.append(dict(case=case, component=component, predicted=pred, measured=meas))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
