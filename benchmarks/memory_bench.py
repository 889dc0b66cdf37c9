"""Peak host memory per rank: start-up (model construction) and one SFT step, on CPU gloo ranks.

    python benchmarks/memory_bench.py [--dps 1,2,4] [--old-dps 1,2] [--verl-dps 1,2] [--dir DIR]

Model: a random Qwen2.5-0.5B-shaped directory (hidden 896, intermediate 4864, 24 layers, 14 heads,
2 kv heads, vocab 151936, tied; 494M parameters, bf16 safetensors), written here tensor by tensor.
Each rank reports ``ru_maxrss`` (its peak resident set) after imports (baseline), after building
the engine (start-up) and after one SFT train step on one 64-token sequence (step).

Rows:
- ours: ``TrainEngine`` as shipped (meta build -> FSDP2 -> local shard -> each rank's safetensors rows).
- old: the previous path, kept only here: ``from_pretrained`` of the full fp32 model on every rank,
  passed to ``TrainEngine(model=...)``, which moves it to the device and then shards it.
- verl fsdp2: verl's own fsdp2 engine (``EngineRegistry``, as tests/integrations/test_verl_engine.py
  runs it on CPU with the cpu_platform shim), fp32, same model, same batch, ``sft_loss``.
Target (ours, start-up): peak <= baseline + 1.25 * fp32 bytes / ranks + largest tensor.
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import shutil
import tempfile

import torch

GB = 1024**3
QWEN_05B = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
SEQ_LEN = 64


def write_model_dir(out: str) -> str:
    """The random bf16 Qwen2.5-0.5B-shaped directory (one tensor in memory at a time) + a tokenizer."""
    from transformers import Qwen2Config

    from verl_balance.engine.materialize import parameters_on_meta
    from verl_balance.models.safetensors_io import TensorSpec, save_hf_directory
    from verl_balance.models.tiny_hf import build_tokenizer

    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    config = Qwen2Config(**QWEN_05B, architectures=["Qwen2ForCausalLM"])
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        skeleton = AutoModelForCausalLM.from_config(config)
    params = list(skeleton.named_parameters())
    specs = [TensorSpec(n, tuple(p.shape), torch.bfloat16) for n, p in params]
    gen = torch.Generator().manual_seed(0)

    def tensors():
        for name, p in params:
            if name.endswith("norm.weight"):
                yield name, torch.ones(p.shape, dtype=torch.bfloat16)
            else:
                yield name, (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)

    save_hf_directory(out, hf_config=config, specs=specs, tensors=tensors())
    build_tokenizer().save_pretrained(out)
    return out


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux: KiB


def _micro_batch():
    ids = torch.randint(3, 1000, (1, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.float()}


def _ours(rank, *, model_dir: str, dp: int, old: bool, step: bool = True):
    from verl_balance.distributed import ParallelLayout
    from verl_balance.engine import EngineConfig, TrainEngine
    from verl_balance.models import build_model
    from verl_balance.models.hf import HFModelConfig

    config = HFModelConfig.from_pretrained(model_dir)
    base = _peak_gb()
    model = None
    if old:  # the previous construction: the full fp32 model on every rank first
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = build_model(config)
    engine = TrainEngine(
        model_config=config,
        engine_config=EngineConfig(),
        layout=ParallelLayout(dp=dp, sp=1, device_type="cpu"),
        model=model,
    )
    del model
    start = _peak_gb()
    if not step:
        return base, start, float("nan")
    engine.train_batch([_micro_batch()])
    return base, start, _peak_gb()


def _verl(rank, *, model_dir: str, dp: int):
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import sft_loss

    from verl_balance.integrations.verl.cpu_shims import platform as cpu_platform  # noqa: F401  (installs the CPU shim)

    model_config = HFModelConfig(
        path=model_dir, use_remove_padding=False, override_config={"attn_implementation": "sdpa"}
    )
    base = _peak_gb()
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="fsdp2",
        model_config=model_config,
        engine_config=FSDPEngineConfig(
            strategy="fsdp2",
            use_torch_compile=False,
            model_dtype="fp32",
            mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
        ),
        optimizer_config=FSDPOptimizerConfig(lr=1e-5, total_training_steps=1),
        checkpoint_config=None,
    )
    engine.initialize()
    start = _peak_gb()
    ids = _micro_batch()["input_ids"][0]
    data = tu.get_tensordict(
        tensor_dict={
            "input_ids": torch.nested.as_nested_tensor([ids], layout=torch.jagged),
            "position_ids": torch.nested.as_nested_tensor([torch.arange(len(ids))], layout=torch.jagged),
            "loss_mask": torch.nested.as_nested_tensor([torch.ones_like(ids)], layout=torch.jagged),
        },
        non_tensor_dict={
            "use_remove_padding": False,
            "use_dynamic_bsz": True,
            "max_token_len_per_gpu": 4 * SEQ_LEN,
            "micro_batch_size_per_gpu": None,
            "temperature": 1.0,
            "global_batch_size": dp,
            "pad_mode": "no_padding",
        },
    )
    with engine.train_mode():
        engine.train_batch(data, loss_function=functools.partial(sft_loss, config=None))
    return base, start, _peak_gb()


def _measure(fn, world: int):
    from verl_balance.distributed.launcher import run_on_ranks

    results = run_on_ranks(fn, world=world)
    return [max(r[i] for r in results) for i in range(3)]  # the worst rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dps", default="1,2,4", help="data-parallel sizes for ours")
    parser.add_argument("--old-dps", default="1,2", help="for the old path (dp=4 needs ~18 GB: off by default)")
    parser.add_argument("--verl-dps", default="1,2", help="for verl's fsdp2 engine ('' to skip)")
    parser.add_argument("--no-step", action="store_true", help="ours: start-up only (no train step)")
    parser.add_argument("--dir", default=None, help="model directory (written if absent; default: a temp dir)")
    args = parser.parse_args()
    tmp = None if args.dir else tempfile.mkdtemp(prefix="memory_bench_")
    model_dir = write_model_dir(args.dir or os.path.join(tmp, "qwen2_0.5b"))
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), framework="pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]
    numel = [int(torch.Size(s).numel()) for s in shapes]
    fp32_bytes, largest = 4 * sum(numel), 4 * max(numel)
    print(f"model: {sum(numel) / 1e6:.0f}M parameters, fp32 {fp32_bytes / GB:.2f} GB, largest {largest / GB:.2f} GB")
    rows = []
    dps = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    for dp in dps(args.old_dps):
        rows.append(("old", dp, _measure(functools.partial(_ours, model_dir=model_dir, dp=dp, old=True), dp)))
        print(rows[-1], flush=True)
    for dp in dps(args.dps):
        fn = functools.partial(_ours, model_dir=model_dir, dp=dp, old=False, step=not args.no_step)
        rows.append(("ours", dp, _measure(fn, dp)))
        print(rows[-1], flush=True)
    for dp in dps(args.verl_dps):
        rows.append(("verl fsdp2", dp, _measure(functools.partial(_verl, model_dir=model_dir, dp=dp), dp)))
        print(rows[-1], flush=True)
    print(
        "\n| path | dp | baseline GB | start-up peak GB | step peak GB | start-up target GB "
        "(base + 1.25*fp32/dp + largest) |"
    )
    print("|---|---|---|---|---|---|")
    for name, dp, (base, start, step) in rows:
        target = base + (1.25 * fp32_bytes / dp + largest) / GB
        print(f"| {name} | {dp} | {base:.2f} | {start:.2f} | {step:.2f} | {target:.2f} |")
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
