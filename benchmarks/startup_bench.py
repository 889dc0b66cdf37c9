"""Start-up to the first step, per phase: ``recipes/sft_cpu_demo.sh``'s run (4 CPU workers, dp=2 x sp=2,
the built-in tiny model, embedded Ray), wall and CPU seconds.

    PYTHONPATH=. python benchmarks/startup_bench.py [--repeats 3] [--against DIR] [-- OVERRIDES...]

Each run is ``python -m verl_balance.main_sft`` with the demo's overrides and
``trainer.total_training_steps=2`` in a fresh subprocess. The phases are read off the driver's log
lines as they arrive (the time of arrival, this process's clock):

- ``imports``: process start to the driver's first log line (interpreter, torch, Hydra, config);
- ``data``: to the ``dataset build`` line (the synthetic task is generated once per run directory);
- ``ray``: the ``cluster`` phase (``ray.init`` of the embedded cluster);
- ``spawn``: the ``worker spawn`` phase (worker processes started, imported, placed);
- ``model load``: the ``model load`` phase;
- ``first step``: the end of model load to the first ``step`` line (first plan, dispatch, step);
- ``to first step``: process start to the first step line.

``cpu s`` is the user + system CPU of the run's process tree (driver, Ray's daemons, workers) at the
end of each phase minus at its start; processes that exited meanwhile are not counted. ``--against
DIR`` runs another checkout (e.g. a worktree of main) interleaved with this one, the order alternating
per repeat, so load drift hits both. The load average is printed with the table: on a shared machine
the wall seconds scale with it; the CPU seconds much less.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO_OVERRIDES = (
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=4",
    "ulysses_sequence_parallel_size=2",
    "model.name=tiny",
    "model.hidden_size=64",
    "model.intermediate_size=192",
    "model.num_layers=2",
    "data.train_batch_size=32",
    "data.micro_batch_size_per_gpu=4",
    "balance.enable=true",
    "balance.workload=flops",
    "trainer.total_epochs=1",
    "trainer.total_training_steps=2",
    "trainer.logger=[console]",
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
)
# (phase, the log line that ends it)
MARKS = (
    ("imports", re.compile(r"^\[\d{4}-")),
    ("data", re.compile(r"dataset build")),
    ("ray", re.compile(r"\] - cluster \(")),
    ("spawn", re.compile(r"worker spawn \(")),
    ("model load", re.compile(r"model load \(")),
    ("first step", re.compile(r"^step 1\b")),
)
PHASES = tuple(name for name, _ in MARKS) + ("to first step",)


def _tree_cpu(pid: int) -> float:
    import psutil

    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = p.cpu_times()
                total += times.user + times.system + times.children_user + times.children_system
    return total


def run_once(repo: str, overrides: list[str], *, timeout: float, log_path: str) -> dict[str, tuple[float, float]]:
    """One start-up of ``repo``'s ``main_sft``: {phase: (wall s, cpu s)}; {} when it failed."""
    run_dir = tempfile.mkdtemp(prefix="startup_bench_")
    env = dict(os.environ, PYTHONPATH=repo, PYTHONUNBUFFERED="1", RAY_ADDRESS="local")
    argv = [sys.executable, "-m", "verl_balance.main_sft", *DEMO_OVERRIDES, f"trainer.default_local_dir={run_dir}"]
    stamps: dict[str, tuple[float, float]] = {}
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv + overrides, env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    marks = list(MARKS)

    def reader():
        with open(log_path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                if marks and marks[0][1].search(line):
                    stamps[marks.pop(0)[0]] = (time.perf_counter() - start, _tree_cpu(proc.pid))

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    thread.join(timeout=30)
    if len(stamps) < len(MARKS):
        print(f"  run of {repo} failed or timed out (log: {log_path})", flush=True)
        return {}
    phases, before = {}, (0.0, 0.0)
    for name, _ in MARKS:
        phases[name] = (stamps[name][0] - before[0], stamps[name][1] - before[1])
        before = stamps[name]
    phases["to first step"] = stamps["first step"]
    return phases


def _median(runs: list[dict], phase: str, index: int) -> str:
    values = [r[phase][index] for r in runs if r]
    return f"{statistics.median(values):.2f}" if values else "n/a"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--against", default=None, help="another checkout, run interleaved with this one")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    args = p.parse_args(argv)
    repos = {"this": REPO, **({"against": os.path.abspath(args.against)} if args.against else {})}
    runs: dict[str, list[dict]] = {name: [] for name in repos}
    loads = [os.getloadavg()[0]]
    log_dir = tempfile.mkdtemp(prefix="startup_bench_logs_")
    for repeat in range(args.repeats):
        order = list(repos) if repeat % 2 == 0 else list(reversed(repos))
        for name in order:
            log = os.path.join(log_dir, f"{name}_{repeat}.log")
            runs[name].append(run_once(repos[name], args.overrides, timeout=args.timeout, log_path=log))
            loads.append(os.getloadavg()[0])
            got = runs[name][-1]
            print(f"  {name} run {repeat}: {got['to first step'][0]:.1f} s to first step" if got else "", flush=True)
    print(f"\nmedians of {args.repeats} run(s); load average (1 min) {min(loads):.1f}-{max(loads):.1f}")
    for name, repo in repos.items():
        print(f"\n{name}: {repo}\n\n| phase | wall s | cpu s |\n| --- | --- | --- |")
        for phase in PHASES:
            print(f"| {phase} | {_median(runs[name], phase, 0)} | {_median(runs[name], phase, 1)} |")


if __name__ == "__main__":
    main()
