"""GRPO step time with and without the on-policy shortcut (no old-log-prob pass), side by side.

    PYTHONPATH=. python benchmarks/grpo_step_bench.py              # 3 rounds x 5 steps per mode
    PYTHONPATH=. python benchmarks/grpo_step_bench.py --quick      # 1 round x 3 steps
    PYTHONPATH=. python benchmarks/grpo_step_bench.py --kl         # with the reference pass (KL loss)

Setup (issue 21's TRL comparison): 16 prompts x 4 responses of up to 32 tokens per step, one PPO
epoch, one mini-batch (``ppo_mini_batch_size = data.train_batch_size``: the update is on-policy),
the CPU demo's tiny model (hidden 64, 2 layers, random weights, byte tokenizer), the synthetic
copy task, 2 CPU workers (embedded Ray). Both modes run ``python -m verl_balance.main_grpo`` with
the same overrides except ``actor_rollout_ref.actor.recompute_old_log_prob``:

- ``always``: verl's step, a separate old-log-prob pass (no-grad forward over the batch) then the
  update;
- ``auto`` (ours, the default): the update forward's detached log-probs are the old log-probs, no
  pass.

Both runs use the same seed, so they sample the same rollouts. Runs are interleaved (always, auto,
always, auto, ...) so load drift on a shared machine hits both alike; the first step of every run
(warm-up) is dropped; each figure is the median over the remaining steps of all rounds, from
``timing_s/*`` in the run's metrics.jsonl. ``ratio`` = always / auto (> 1: the shortcut is faster).
With ``--kl`` the reference pass runs in both modes and overlaps the driver's reward scoring.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

DIMS = ("hidden_size=64", "intermediate_size=192", "num_layers=2")
KEYS = ("step", "gen", "reward", "old_log_prob", "ref", "adv", "update_actor")
MODES = ("always", "auto")


def overrides(*, out_dir: str, data_dir: str, mode: str, steps: int, kl: bool) -> list[str]:
    """The main_grpo command-line overrides of one run."""
    return [
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        "trainer.test_freq=-1",
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
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.response_length=32",
        f"actor_rollout_ref.actor.use_kl_loss={str(kl).lower()}",
        f"actor_rollout_ref.actor.recompute_old_log_prob={mode}",
    ]


def run_once(*, root: str, mode: str, index: int, steps: int, kl: bool) -> list[dict]:
    """One main_grpo run; its step records after the warm-up step."""
    out_dir = os.path.join(root, f"{mode}_{index}")
    args = overrides(out_dir=out_dir, data_dir=os.path.join(root, "data"), mode=mode, steps=steps, kl=kl)
    proc = subprocess.run([sys.executable, "-m", "verl_balance.main_grpo", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"main_grpo ({mode}) failed:\n{proc.stderr[-4000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    train = sorted((r for r in records if r.get("step", 0) >= 1 and "timing_s/step" in r), key=lambda r: r["step"])
    return train[1:]


def table(records: dict[str, list[dict]]) -> str:
    """Median seconds per phase for each mode and the always / auto ratio."""
    lines = [f"{'timing_s (median)':<20}{'always':>10}{'auto':>10}{'ratio':>8}"]
    for key in KEYS:
        cells = []
        for mode in MODES:
            values = [r[f"timing_s/{key}"] for r in records[mode] if f"timing_s/{key}" in r]
            cells.append(float(np.median(values)) if values else None)
        fmt = ["-" if c is None else f"{c:.3f}" for c in cells]
        ratio = f"{cells[0] / cells[1]:.2f}" if None not in cells and cells[1] > 0 else "-"
        lines.append(f"{key:<20}{fmt[0]:>10}{fmt[1]:>10}{ratio:>8}")
    counts = {mode: len(records[mode]) for mode in MODES}
    passes = {mode: sorted({r.get("train/old_log_prob_pass") for r in records[mode]}) for mode in MODES}
    lines.append(f"steps timed: {counts}; train/old_log_prob_pass: {passes}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs per mode")
    parser.add_argument("--steps", type=int, default=5, help="steps per run (the first is warm-up)")
    parser.add_argument("--kl", action="store_true", help="KL loss: the reference pass runs too")
    parser.add_argument("--quick", action="store_true", help="1 round x 3 steps (smoke run)")
    args = parser.parse_args()
    rounds, steps = (1, 3) if args.quick else (args.rounds, args.steps)
    records: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="grpo_step_bench_") as root:
        for index in range(rounds):
            order = MODES if index % 2 == 0 else MODES[::-1]
            for mode in order:
                records[mode] += run_once(root=root, mode=mode, index=index, steps=steps, kl=args.kl)
                print(f"round {index + 1}/{rounds}: {mode} done", file=sys.stderr, flush=True)
    print(f"GRPO step, 16 prompts x 4 responses x <=32 tokens, 2 CPU workers, kl={args.kl}")
    print(table(records))


if __name__ == "__main__":
    main()
