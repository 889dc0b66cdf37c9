"""Resident memory over a long SFT run: does any process grow step after step?

    PYTHONPATH=. python benchmarks/rss_bench.py                 # 1,000 steps, sampled every 100
    PYTHONPATH=. python benchmarks/rss_bench.py --steps 200 --every 50

One SFT run of the built-in ``tiny`` model on 2 CPU workers (embedded Ray, the synthetic task,
no checkpoints, no validation). The RSS (psutil) of the driver and of each worker process is
read from the driver after set-up (step 0) and every ``--every`` steps; the table prints each
sample and its growth since the previous one (per ``--every`` steps), and the last lines the
least-squares slope per 100 steps over the samples after the first ``--every`` steps (warm-up:
allocator pools, caches). A leak shows as a steady positive slope; noise as a few MiB either way.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import ray

REPO = Path(__file__).resolve().parents[1]
MIB = 1024.0 * 1024.0


def compose_sft(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from verl_balance.trainer.config import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "verl_balance" / "config"), version_base="1.3"):
        return compose(config_name="sft", overrides=overrides)


def run(args) -> list[tuple[int, list[float]]]:
    """(step, [driver, rank 0, rank 1, ...] RSS in MiB) samples of one SFT run."""
    from verl_balance.trainer.sft_trainer import SFTTrainer

    tmp = tempfile.mkdtemp(prefix="vb_rss_")
    cfg = compose_sft(
        [
            "trainer.device=cpu",
            f"model.name={args.model}",
            f"trainer.n_gpus_per_node={args.workers}",
            "data.train_batch_size=8",
            "data.micro_batch_size_per_gpu=2",
            "data.synthetic.num_train=512",
            "data.synthetic.num_val=8",
            f"data.synthetic.out_dir={tmp}/data",
            f"trainer.default_local_dir={tmp}/run",
            f"trainer.total_training_steps={args.steps}",
            "trainer.logger=[jsonl]",
            "trainer.plot=false",
            "trainer.resume_mode=disable",
        ]
    )
    trainer = SFTTrainer(cfg)
    try:
        worker_pids = [ray.get(w.__ray_call__.remote(lambda self: os.getpid())) for w in trainer.actor.workers]
        processes = [psutil.Process(), *(psutil.Process(pid) for pid in worker_pids)]
        samples = [(0, [p.memory_info().rss / MIB for p in processes])]
        step = trainer.train_step
        start = time.perf_counter()

        def train_step_sampled(item):
            metrics = step(item)
            done = trainer.global_step + 1  # global_step counts this step only after it returns
            if done % args.every == 0:
                samples.append((done, [p.memory_info().rss / MIB for p in processes]))
                print(f"[rss] step {done}/{args.steps} ({time.perf_counter() - start:.0f} s)", flush=True)
            return metrics

        trainer.train_step = train_step_sampled
        trainer.fit()
    finally:
        trainer.close()
    return samples


def print_table(samples: list[tuple[int, list[float]]], *, every: int, workers: int) -> None:
    names = ["driver", *(f"rank {r}" for r in range(workers))]
    header = ["step", *(f"{n} [MiB]" for n in names), *(f"{n} +/{every} steps" for n in names)]
    rows = []
    for i, (step, rss) in enumerate(samples):
        growth = ["" for _ in rss] if i == 0 else [f"{b - a:+.1f}" for a, b in zip(samples[i - 1][1], rss)]
        rows.append([str(step), *(f"{x:.1f}" for x in rss), *growth])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\nRSS per process, SFT tiny model, {workers} CPU workers (psutil, sampled every {every} steps)")
    for line in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    steady = [(s, rss) for s, rss in samples if s >= every]
    if len(steady) >= 2:
        steps = np.array([s for s, _ in steady], dtype=float)
        values = np.array([rss for _, rss in steady])
        slopes = [np.polyfit(steps, values[:, j], 1)[0] * 100 for j in range(values.shape[1])]
        total = values[-1] - values[0]
        print(f"\nslope (least squares over steps {int(steps[0])}..{int(steps[-1])}), MiB per 100 steps:")
        for name, slope, grown in zip(names, slopes, total):
            print(f"  {name:>8}: {slope:+.2f} MiB/100 steps ({grown:+.1f} MiB in all)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="ModelConfig preset")
    args = parser.parse_args()
    print(f"[setup] {args.steps} steps, {args.workers} workers, cores {os.cpu_count()}, load {os.getloadavg()}")
    samples = run(args)
    print_table(samples, every=args.every, workers=args.workers)
    print(f"\nload average after the run: {os.getloadavg()}; python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
