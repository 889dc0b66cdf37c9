"""Synchronous vs one-step off-policy GRPO (``trainer.v1.trainer_mode``) on the CPU demo, and the
weight sync's bytes and seconds at the Qwen2.5-0.5B shape (full, and LoRA adapters-only bytes).

    PYTHONPATH=. python benchmarks/async_bench.py                 # 2 rounds x 6 steps per mode + sync shape
    PYTHONPATH=. python benchmarks/async_bench.py --quick         # 1 round x 4 steps
    PYTHONPATH=. python benchmarks/async_bench.py --sync-only     # only the 0.5B weight-sync figures

Modes (same seed, data and sizes; 16 prompts x 8 responses x <= 16 tokens, one mini-batch, the
demo's tiny model, 2 CPU cores):

- ``sync``: 1 worker, generation then scoring then update;
- ``colocate_async``: 1 worker, one-step off-policy on its own rollout: batch k+1's generation is
  queued on the worker before batch k's updates (only the driver's scoring and planning overlap it);
- ``separate_async``: 1 trainer worker + 1 rollout worker on its own pool (verl's
  ``actor_rollout_ref.rollout.nnodes=1 n_gpus_per_node=1``), ``num_warmup_batches=1``: batch k+1
  generates while batch k trains (one-step off-policy).

Runs are interleaved (sync, async, async, sync, ...); the first step of each run is dropped; each
figure is the median over the remaining steps. The async bound is max(generation, training) per
step: generation = the rollout worker's busy seconds (``timing_s/rollout_busy_max``), training =
reward + advantages + update (``timing_s/reward + adv + update_actor``); ``step / bound`` is 1.0 for a
perfect overlap.

Weight sync at the 0.5B shape (``--sync-only`` or after the runs): a random state dict of
Qwen2.5-0.5B's tensor shapes in fp32 (built in memory, nothing downloaded) goes through the
driver's path of ``AsyncGRPOTrainer.sync_weights`` on one process: buckets of
``DEFAULT_BUCKET_BYTES`` (``plan_buckets``), each cloned to CPU (the actor's export; the
all-gather of a sharded actor is not in this figure), ``ray.put`` and copied into a second
state dict (the rollout worker's ``receive_weights``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

DIMS = ("hidden_size=64", "intermediate_size=192", "num_layers=2")
MODES = ("sync", "colocate_async", "separate_async")
QWEN_05B = {"vocab": 151936, "hidden": 896, "layers": 24, "intermediate": 4864, "heads": 14, "kv_heads": 2}


def overrides(*, out_dir: str, data_dir: str, mode: str, steps: int) -> list[str]:
    """The main_grpo overrides of one run."""
    common = [
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={out_dir}",
        "actor_rollout_ref.model.name=tiny",
        *(f"actor_rollout_ref.model.{d}" for d in DIMS),
        f"data.synthetic.out_dir={data_dir}",
        "data.synthetic.num_train=1024",
        "data.synthetic.num_val=8",
        "data.synthetic.tasks=[copy]",
        "data.synthetic.max_size=6",
        "data.max_prompt_length=32",
        "data.train_batch_size=16",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.response_length=16",
        f"trainer.v1.trainer_mode={mode}",
    ]
    if mode == "separate_async":
        common += [
            "trainer.v1.separate_async.parameter_sync_step=1",
            "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1",
        ]
    return common


def run_once(*, root: str, mode: str, index: int, steps: int) -> list[dict]:
    """One main_grpo run; its step records after the warm-up step."""
    out_dir = os.path.join(root, f"{mode}_{index}")
    args = overrides(out_dir=out_dir, data_dir=os.path.join(root, "data"), mode=mode, steps=steps)
    env = {**os.environ, "RAY_ADDRESS": "local"}  # a cluster of its own, even beside other jobs' clusters
    proc = subprocess.run(
        [sys.executable, "-m", "verl_balance.main_grpo", *args], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"main_grpo ({mode}) failed:\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = sorted((r for r in records if r.get("step", 0) >= 1 and "timing_s/step" in r), key=lambda r: r["step"])
    return train[1:]


def _cell(value: float | None) -> str:
    return f"{'-':>16}" if value is None else f"{value:>16.3f}"


def _median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return float(np.median(values)) if values else None


def table(records: dict[str, list[dict]]) -> str:
    """Median step time and tokens/s per mode, the sync/mode ratios and the async overlap bound."""
    lines = [f"{'median':<28}" + "".join(f"{m:>16}" for m in MODES)]
    for key in ("timing_s/step", "perf/tokens_per_s", "timing_s/gen", "timing_s/update_actor", "timing_s/weight_sync"):
        lines.append(f"{key:<28}" + "".join(_cell(_median(records[m], key)) for m in MODES))
    step = {m: _median(records[m], "timing_s/step") for m in MODES}
    lines.append(f"{'sync step / mode step':<28}" + "".join(f"{step['sync'] / step[m]:>16.2f}" for m in MODES))
    ratios = []
    for r in records["separate_async"]:
        train = sum(r.get(f"timing_s/{k}", 0.0) for k in ("reward", "adv", "update_actor"))
        ratios.append(r["timing_s/step"] / max(r["timing_s/rollout_busy_max"], train))
    lines.append(f"async step / max(generation, training): median {np.median(ratios):.2f} (1.0 = perfect overlap)")
    lines.append(f"steps timed: { {m: len(records[m]) for m in MODES} }")
    return "\n".join(lines)


def qwen_05b_shapes() -> dict[str, tuple[int, ...]]:
    """Tensor shapes of Qwen2.5-0.5B (tied embeddings: no separate lm_head)."""
    c = QWEN_05B
    head_dim = c["hidden"] // c["heads"]
    kv = c["kv_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (c["vocab"], c["hidden"]), "model.norm.weight": (c["hidden"],)}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (c["hidden"], c["hidden"]),
                p + "self_attn.q_proj.bias": (c["hidden"],),
                p + "self_attn.k_proj.weight": (kv, c["hidden"]),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, c["hidden"]),
                p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (c["hidden"], c["hidden"]),
                p + "mlp.gate_proj.weight": (c["intermediate"], c["hidden"]),
                p + "mlp.up_proj.weight": (c["intermediate"], c["hidden"]),
                p + "mlp.down_proj.weight": (c["hidden"], c["intermediate"]),
                p + "input_layernorm.weight": (c["hidden"],),
                p + "post_attention_layernorm.weight": (c["hidden"],),
            }
        )
    return shapes


def lora_sync_bytes_at_05b(*, rank: int = 32) -> str:
    """Bytes of a LoRA sync (adapters only, rank ``rank`` on every decoder Linear) at the 0.5B
    shape, against the full sync's (fp32; arithmetic from the shapes)."""
    shapes = qwen_05b_shapes()
    full = 4 * sum(int(np.prod(shape)) for shape in shapes.values())
    linears = [shape for name, shape in shapes.items() if name.endswith("_proj.weight")]
    adapters = 4 * sum(rank * (rows + cols) for rows, cols in linears)  # A: r x in, B: out x r
    return (
        f"LoRA sync at the Qwen2.5-0.5B shape (rank {rank}, {len(linears)} Linears): {adapters / 2**20:.1f} MiB per "
        f"step after the first sync, vs {full / 2**20:.0f} MiB full ({full / adapters:.0f}x fewer bytes)"
    )


def weight_sync_at_05b(*, repeats: int = 2) -> str:
    """Bytes, buckets and seconds of one sync at the 0.5B shape (see the module docstring)."""
    import ray
    import torch

    from verl_balance.workers.weight_sync import DEFAULT_BUCKET_BYTES, plan_buckets

    gen = torch.Generator().manual_seed(0)
    actor = {name: torch.randn(shape, generator=gen) for name, shape in qwen_05b_shapes().items()}
    rollout = {name: torch.empty_like(t) for name, t in actor.items()}
    sizes = [(name, t.numel() * t.element_size()) for name, t in actor.items()]
    buckets = plan_buckets(sizes, bucket_bytes=DEFAULT_BUCKET_BYTES)
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    seconds = []
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            for names in buckets:
                ref = ray.put({n: actor[n].clone() for n in names})
                for n, t in ray.get(ref).items():
                    rollout[n].copy_(t)
                del ref
            seconds.append(time.perf_counter() - start)
    finally:
        ray.shutdown()
    assert all(torch.equal(actor[n], rollout[n]) for n in actor)
    total = sum(b for _, b in sizes)
    return (
        f"weight sync at the Qwen2.5-0.5B shape (fp32, {len(actor)} tensors): {total / 2**30:.2f} GiB in "
        f"{len(buckets)} buckets of <= {DEFAULT_BUCKET_BYTES >> 20} MiB; {min(seconds):.2f} s per sync "
        f"(best of {repeats}; {total / min(seconds) / 2**30:.2f} GiB/s through the object store, 1 process)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved runs per mode")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is warm-up)")
    parser.add_argument("--quick", action="store_true", help="1 round x 4 steps")
    parser.add_argument("--sync-only", action="store_true", help="only the 0.5B weight-sync figures")
    args = parser.parse_args()
    if not args.sync_only:
        rounds, steps = (1, 4) if args.quick else (args.rounds, args.steps)
        records: dict[str, list[dict]] = {mode: [] for mode in MODES}
        with tempfile.TemporaryDirectory(prefix="async_bench_") as root:
            for index in range(rounds):
                for mode in MODES if index % 2 == 0 else MODES[::-1]:
                    records[mode] += run_once(root=root, mode=mode, index=index, steps=steps)
                    print(f"round {index + 1}/{rounds}: {mode} done", file=sys.stderr, flush=True)
        print("GRPO, 16 prompts x 8 responses x <=16 tokens, tiny model, 1 trainer worker (+1 rollout worker)")
        print(table(records))
    print(weight_sync_at_05b())
    print(lora_sync_bytes_at_05b())


if __name__ == "__main__":
    main()
