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

A second table splits the process tree's CPU seconds at the first step by process (driver, preload server,
workers, each of Ray's daemons). The *library floor*, measured in the same run, is what no code of ours can
remove on this host: the CPU seconds of a fresh interpreter importing the driver's libraries
(``DRIVER_LIBRARIES``), one importing what the run's preload server imports (``ray_start.worker_preload``),
and Ray's daemons as the run measured them. Divided by the core count it bounds the wall time to the first
step from below; start-up minus that bound is the part the code here decides (the driver's own Ray client,
config, data and plan among it), comparable across hosts of different speed.
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
# The third-party libraries the driver imports before its first step (config, data, Ray, the Batch).
DRIVER_LIBRARIES = ("torch", "tensordict", "ray", "hydra", "pyarrow.parquet")
# Ray's own processes of the embedded cluster, by a piece of their command line or process title.
RAY_DAEMONS = (
    ("gcs_server", "Ray GCS"),
    ("raylet", "Ray raylet"),
    ("DashboardAgent", "Ray dashboard agent"),
    ("dashboard/agent.py", "Ray dashboard agent"),
    ("RuntimeEnvAgent", "Ray runtime-env agent"),
    ("runtime_env/agent", "Ray runtime-env agent"),
    ("log_monitor", "Ray log monitor"),
)


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


def _role(cmdline: str, *, is_root: bool) -> str:
    if is_root:
        return "driver"
    if "forked_workers.py --serve" in cmdline:
        return "preload server"
    for piece, role in RAY_DAEMONS:
        if piece in cmdline:
            return role
    return "workers" if cmdline.startswith("ray::") else "other"


def _cpu_by_role(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s process tree by role (processes that already exited are not counted)."""
    import psutil

    roles: dict[str, float] = {}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times, cmdline = p.cpu_times(), " ".join(p.cmdline())
                role = _role(cmdline, is_root=p.pid == pid)
                roles[role] = roles.get(role, 0.0) + times.user + times.system
    return roles


def import_cpu(modules: tuple[str, ...]) -> float:
    """CPU seconds of a fresh interpreter that imports ``modules`` (the interpreter's own start included)."""
    code = f"import importlib, resource\nfor m in {modules!r}: importlib.import_module(m)\n" + (
        "r = resource.getrusage(resource.RUSAGE_SELF); print(r.ru_utime + r.ru_stime)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def run_once(repo: str, overrides: list[str], *, timeout: float, log_path: str) -> dict:
    """One start-up of ``repo``'s ``main_sft``: {phase: (wall s, cpu s)} and, under "by process", the CPU
    seconds by process at the first step; {} when it failed."""
    run_dir = tempfile.mkdtemp(prefix="startup_bench_")
    env = dict(os.environ, PYTHONPATH=repo, PYTHONUNBUFFERED="1", RAY_ADDRESS="local")
    argv = [sys.executable, "-m", "verl_balance.main_sft", *DEMO_OVERRIDES, f"trainer.default_local_dir={run_dir}"]
    stamps: dict[str, tuple[float, float]] = {}
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv + overrides, env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    marks = list(MARKS)
    by_role: dict[str, float] = {}

    def reader():
        with open(log_path, "w") as log:
            for line in proc.stdout:
                log.write(line)
                if marks and marks[0][1].search(line):
                    stamps[marks.pop(0)[0]] = (time.perf_counter() - start, _tree_cpu(proc.pid))
                    if not marks:
                        by_role.update(_cpu_by_role(proc.pid))

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
    phases["by process"] = by_role
    return phases


def _median(runs: list[dict], phase: str, index: int) -> str:
    values = [r[phase][index] for r in runs if r]
    return f"{statistics.median(values):.2f}" if values else "n/a"


def print_by_process(runs: list[dict]) -> None:
    roles = sorted({role for r in runs if r for role in r["by process"]})
    print("\n| process (CPU s at the first step) | median |\n| --- | --- |")
    for role in roles:
        print(f"| {role} | {statistics.median(r['by process'].get(role, 0.0) for r in runs if r):.2f} |")


def print_floor(runs: list[dict], floors: dict[str, list[float]]) -> None:
    """The library floor of this host (module docstring) beside this checkout's start-up."""
    ok = [r for r in runs if r]
    if not ok:
        return
    daemons = {role for _, role in RAY_DAEMONS}
    ray_cpu = statistics.median(sum(v for k, v in r["by process"].items() if k in daemons) for r in ok)
    driver, workers = statistics.median(floors["driver"]), statistics.median(floors["workers"])
    floor = driver + workers + ray_cpu
    cores = os.cpu_count() or 1
    wall = statistics.median(r["to first step"][0] for r in ok)
    print(
        f"\nlibrary floor: {floor:.2f} CPU s = driver's libraries {driver:.2f} + workers' libraries {workers:.2f}"
        f" + Ray's daemons {ray_cpu:.2f}; on {cores} cores at least {floor / cores:.2f} s."
        f"\nto first step: {wall:.2f} s, {wall / (floor / cores):.2f}x the floor, {wall - floor / cores:.2f} s above it"
    )


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
    from verl_balance.trainer.ray_start import worker_preload

    floors: dict[str, list[float]] = {"driver": [], "workers": []}
    for repeat in range(args.repeats):
        floors["driver"].append(import_cpu(DRIVER_LIBRARIES))
        floors["workers"].append(import_cpu(worker_preload([*DEMO_OVERRIDES, *args.overrides])))
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
        print_by_process(runs[name])
        print_floor(runs[name], floors)


if __name__ == "__main__":
    main()
