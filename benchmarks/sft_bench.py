"""SFT training benchmarks, each printed as one side-by-side table.

    PYTHONPATH=. python benchmarks/sft_bench.py                # all four tables (a few minutes)
    PYTHONPATH=. python benchmarks/sft_bench.py step           # or: overhead | memory | sync
    PYTHONPATH=. python benchmarks/sft_bench.py --quick        # smoke run: tiny model, 1 + 3 steps
                                                               # (mostly Ray start-up)

step      Step time on dp=2 CPU workers (one Ray worker group, reused): each step is 32 sequences
          with lengths lognormal(median, sigma=1.2) in random order, clipped to [8, max_len].
          Micro-batching is fixed (micro_batch_size_per_gpu=4) or a token cap per worker. Plans:
          ours (plan_balance, FLOPs workload, as the SFT trainer runs it), contiguous
          (balance=False) and verl 0.9.1's two-stage balancing (benchmarks/verl_plans.py runs
          verl's own code under --verl-python; the row is "n/a" when verl is not importable).
          The worker group, the batches and everything else are shared; only the plan differs.
          Methods are interleaved step by step (order rotated) so load drifts hit them alike.
          Figures (medians over timed steps): driver wall time of update_actor; "cpu sync" = sum
          over micro-batch slots of the max over ranks of the slot's CPU seconds, i.e. the step
          time the ranks would take on cores of their own (a blocking gloo wait costs no CPU;
          this is the load-robust figure on a shared machine); the plan's predicted sync cost
          (same sum with the FLOPs model); each relative to contiguous; meas/pred = measured cpu
          sync ratio / predicted ratio (target <= 1.05). "rank" columns: the max over ranks of the
          rank's total busy CPU, measured and predicted (what a step costs when nothing
          synchronises per micro-batch, --fsdp deferred+unsharded). With the default FSDP
          settings every micro-batch synchronises, so on dedicated cores wall time follows the
          sync cost.
          --calibration FILE (python -m verl_balance.calibrate --model small --attn-impl sdpa_loop
          --world 2 --out FILE): ours plans with the calibrated workload (fixed cost per
          micro-batch + per sequence/token/attention pair, in seconds) and every prediction uses
          it, fixed cost included; "pred bound/contig" is the model's lower bound (fewest
          micro-batches x fixed cost + total / dp) over contiguous: no plan's prediction is lower.
overhead  Training tokens/s at dp=1: SFTTrainer.train_step (plan, split, Ray dispatch, FSDP2
          engine) vs a plain single-process PyTorch loop (build_model, AdamW, packed forward,
          token-mean NLL, grad clipping) in a spawned process, same batches and the same
          micro-batch membership (the trainer's plan), one torch thread each, interleaved.
sync      Tokens/s at dp=2 (same batches, same balanced plans, fixed micro-batches) for the FSDP2
          gradient-accumulation settings of FSDPConfig: per-micro-batch gradient sync (default),
          deferred gradient sync (one reduce-scatter per step), and deferred sync with parameters
          kept unsharded for the whole step (one all-gather per step); one worker group each, all
          up at once, steps interleaved; with the peak RSS (VmHWM) of each group's workers.
memory    Peak RSS per worker (VmHWM after resetting it via /proc/self/clear_refs, plus the
          lifetime getrusage ru_maxrss) for each plan at dp=2, and for the dp=1 trainer worker vs
          the plain loop's process.

The attention kernel is "sdpa_loop" (per-sequence causal SDPA, cost quadratic per sequence as
flash-attn's on GPU) for the step table; CPU's default "sdpa_masked" is quadratic in the packed
micro-batch length, which no per-sequence workload model describes (--attn-impl to change).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from verl_balance.balance import BalancePlan, FlopsWorkload, plan_balance
from verl_balance.balance.workload import CalibratedWorkload, micro_batch_overhead
from verl_balance.engine.config import EngineConfig, FSDPConfig, OptimConfig
from verl_balance.models import ModelConfig, build_model
from verl_balance.protocol import Batch
from verl_balance.single_controller import Dispatch, make_mesh_dispatch, register
from verl_balance.trainer import cluster
from verl_balance.trainer.plan_dispatch import split_by_plan
from verl_balance.workers.actor import ACTOR_MESH, ActorWorker, ActorWorkerConfig

REPO = Path(__file__).resolve().parents[1]
MIB = 1024.0


# ---------------------------------------------------------------------- memory probes
def _status_mib(*keys: str) -> dict[str, float]:
    """Fields of /proc/self/status (kB) in MiB; {} off Linux."""
    out = {}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in keys:
                    out[name] = float(value.split()[0]) / MIB
    except OSError:
        pass
    return out


def memory_snapshot(*, reset_peak: bool = False) -> dict:
    """RSS now, peak since the last reset (VmHWM) and lifetime peak (getrusage), in MiB."""
    status = _status_mib("VmRSS", "VmHWM")
    snap = {
        "rss_mib": status.get("VmRSS", float("nan")),
        "peak_mib": status.get("VmHWM", float("nan")),
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / MIB,
    }
    if reset_peak:
        try:  # "5" resets VmHWM to the current RSS (Linux >= 4.0); getrusage keeps the lifetime peak
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            snap["peak_reset"] = True
        except OSError:
            snap["peak_reset"] = False
    return snap


class BenchActorWorker(ActorWorker):
    """ActorWorker whose update_actor also reports CPU time (benchmark only).

    CPU time is what a rank would spend on a core of its own: time blocked in a gloo collective
    costs none. Per micro-batch it is the engine's own busy time (process CPU seconds of each
    micro-batch's forward + backward on CPU, engine/timing.py): ``bench_micro_cpu[j]``.
    """

    @register(dispatch_mode=make_mesh_dispatch(ACTOR_MESH))
    def update_actor(self, batch: Batch) -> dict:
        """ActorWorker.update_actor plus bench_cpu_time, bench_thread_time, bench_micro_cpu, and the
        wall time of the call (bench_update_wall) and of its forwards + backwards (bench_compute_wall)."""
        cpu, thread, wall = time.process_time(), time.thread_time(), time.perf_counter()
        with _profiled("worker"):
            metrics = super().update_actor(batch)
        metrics["bench_update_wall"] = time.perf_counter() - wall
        metrics["bench_cpu_time"] = time.process_time() - cpu
        metrics["bench_thread_time"] = time.thread_time() - thread
        metrics["bench_micro_cpu"] = list(metrics["micro_batch_busy_seconds"])
        metrics["bench_compute_wall"] = float(sum(metrics["micro_batch_seconds"]))
        metrics["bench_compute_cpu"] = float(sum(metrics["micro_batch_busy_seconds"]))
        return metrics

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def memory(self, reset_peak: bool = False) -> dict:
        """memory_snapshot() of this worker (optionally resetting its peak afterwards)."""
        return {"rank": self.rank, **memory_snapshot(reset_peak=reset_peak)}


PROFILE_ENV = "VB_BENCH_PROFILE_DIR"
"""--profile DIR: the driver's train_step and the worker's update_actor run under cProfile; each
process adds its calls to DIR/<name>.prof (read with python -m pstats)."""


@contextlib.contextmanager
def _profiled(name: str):
    out_dir = os.environ.get(PROFILE_ENV)
    if not out_dir:
        yield
        return
    import cProfile

    profiler = _PROFILERS.setdefault(name, cProfile.Profile())
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(os.path.join(out_dir, f"{name}.prof"))


_PROFILERS: dict = {}


def bench_trainer_class(trainer_cls: type) -> type:
    """``trainer_cls`` whose worker group runs ``BenchActorWorker`` (the probing worker class)."""

    class BenchTrainer(trainer_cls):
        def start_workers(self, *, worker_config, worker_cls=None, description: str) -> None:
            super().start_workers(worker_config=worker_config, worker_cls=BenchActorWorker, description=description)

    return BenchTrainer


# ---------------------------------------------------------------------- data
@dataclass(frozen=True)
class StepWorkload:
    """Global batches of lognormal lengths; the figures the tables state."""

    batch_size: int = 32
    median: int = 24
    sigma: float = 1.2
    min_len: int = 8
    max_len: int = 288
    seed: int = 0


def make_batches(workload: StepWorkload, *, num: int, vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """``num`` right-padded batches (input_ids, attention_mask, loss_mask, position_ids).

    Lengths in random order; loss on every token but the first (its target is token 1 onward).
    """
    rng = np.random.default_rng(workload.seed)
    gen = torch.Generator().manual_seed(workload.seed)
    batches = []
    for _ in range(num):
        lengths = np.clip(
            np.round(rng.lognormal(np.log(workload.median), workload.sigma, workload.batch_size)),
            workload.min_len,
            workload.max_len,
        ).astype(np.int64)
        width = int(lengths.max())
        mask = (torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]).long()
        loss_mask = mask.clone()
        loss_mask[:, 0] = 0
        batches.append(
            {
                "input_ids": torch.randint(0, vocab_size, (workload.batch_size, width), generator=gen) * mask,
                "attention_mask": mask,
                "loss_mask": loss_mask,
                "position_ids": (torch.cumsum(mask, 1) - 1).clamp_min(0) * mask,
            }
        )
    return batches


def seq_lens(tensors: dict[str, torch.Tensor]) -> np.ndarray:
    return tensors["attention_mask"].sum(1).numpy()


# ---------------------------------------------------------------------- plans
def verl_plans(lengths: list[np.ndarray], *, dp: int, cases: list[dict], verl_python: str):
    """verl's two-stage plans per case and batch, from benchmarks/verl_plans.py under verl's venv.

    Returns (plans per case or None, a note saying which verl ran or why it did not).
    """
    if not verl_python or not os.path.exists(verl_python):
        return None, f"verl not run: no python at {verl_python!r}"
    request = [
        {
            "dp": dp,
            "micro_batch_size": c["micro_batch_size"],
            "max_token_len_per_gpu": c["token_cap"],
            "batches": [[int(x) for x in lens] for lens in lengths],
        }
        for c in cases
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [verl_python, str(REPO / "benchmarks" / "verl_plans.py")],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return None, f"verl not importable: {lines[-1] if lines else f'exit {proc.returncode}'}"
    reply = json.loads(proc.stdout)
    plans = [
        [
            BalancePlan(micro_batches=[[np.asarray(mb, dtype=np.int64) for mb in rank] for rank in cells])
            for cells in case
        ]
        for case in reply["cases"]
    ]
    return plans, f"verl {reply['verl_version']} (its own code, under {verl_python})"


def sync_cost(plan: BalancePlan, costs: np.ndarray, micro_batch_cost: float = 0.0) -> float:
    """sum over micro-batch slots of the max over DP ranks of the slot's cost (what FSDP waits for);
    every slot also pays the workload's fixed cost per micro-batch."""
    grid = np.array([[costs[mb].sum() + micro_batch_cost for mb in rank] for rank in plan.micro_batches])
    return float(grid.max(axis=0).sum())


def max_rank_cost(plan: BalancePlan, costs: np.ndarray, micro_batch_cost: float = 0.0) -> float:
    """max over DP ranks of the rank's total cost (the step time when nothing syncs per micro-batch)."""
    return float(max(sum(costs[mb].sum() + micro_batch_cost for mb in rank) for rank in plan.micro_batches))


# ---------------------------------------------------------------------- step table
def run_step_bench(args, memory_rows: list) -> list[tuple]:
    model_config = ModelConfig.preset(args.model)
    workload = StepWorkload(median=args.median, max_len=args.max_len)
    engine = EngineConfig(
        optim=OptimConfig(lr=1e-4), attn_impl=args.attn_impl, seed=0, fsdp=FSDPConfig(**FSDP_SETTINGS[args.fsdp])
    )
    flops = FlopsWorkload.from_model_config(model_config)
    if args.calibration:
        flops = CalibratedWorkload.from_file(args.calibration)  # ours plans with it and predicts with it
        print(f"[step] {flops.describe()}", flush=True)
    c0 = micro_batch_overhead(flops)
    total = args.warmup + args.steps
    batches = make_batches(workload, num=total, vocab_size=model_config.vocab_size)
    lengths = [seq_lens(b) for b in batches]
    token_cap = args.token_cap or workload.max_len
    cases = [
        ("fixed mbs=4", dict(micro_batch_size=4, token_cap=None)),
        (f"token cap {token_cap}", dict(micro_batch_size=None, token_cap=token_cap)),
    ]

    plans: dict[tuple[str, str], list] = {}
    verl, note = verl_plans(lengths, dp=2, cases=[kw for _, kw in cases], verl_python=args.verl_python)
    print(f"[step] verl column: {note}", flush=True)
    for i, (case, kw) in enumerate(cases):
        for method, balance in (("contiguous", False), ("ours", True)):
            plans[case, method] = [
                plan_balance(
                    seq_lens=lens,
                    dp_size=2,
                    micro_batch_size=kw["micro_batch_size"],
                    max_token_len_per_gpu=kw["token_cap"],
                    balance=balance,
                    workload=flops,
                )
                for lens in lengths
            ]
        if verl is not None:
            plans[case, "verl"] = verl[i]

    cluster.start_ray(address=None, num_workers=2)
    start = time.perf_counter()
    group = cluster.build_actor_group(
        worker_config=ActorWorkerConfig(model=model_config, engine=engine),
        trainer_cfg=SimpleNamespace(n_gpus_per_node=2, nnodes=1, placement_timeout_s=300.0),
        use_gpu=False,
        worker_cls=BenchActorWorker,
    )
    print(f"[step] dp=2 worker group up in {time.perf_counter() - start:.1f} s", flush=True)
    try:
        samples: dict[tuple[str, str], list] = {key: [] for key in plans}
        keys = list(plans)
        for step in range(total):
            for key in keys[step % len(keys) :] + keys[: step % len(keys)]:  # rotate: no fixed position
                plan = plans[key][step]
                chunks = split_by_plan(Batch.from_dict(tensors=batches[step]), plan)
                t0 = time.perf_counter()
                per_rank = group.update_actor(chunks)
                wall = time.perf_counter() - t0
                if step >= args.warmup:
                    micro_cpu = np.array([r["bench_micro_cpu"] for r in per_rank])  # [rank, micro]
                    samples[key].append(
                        (
                            wall,
                            float(micro_cpu.max(axis=0).sum()),
                            max(r["bench_thread_time"] for r in per_rank),
                            plan.num_micro_batches,
                            float(micro_cpu.sum(axis=1).max()),
                        )
                    )
            print(f"[step] {step + 1}/{total} done", flush=True)
        if memory_rows is not None:
            for key in plans:
                group.memory(True)
                for step in range(min(2, total)):
                    group.update_actor(split_by_plan(Batch.from_dict(tensors=batches[step]), plans[key][step]))
                for snap in group.memory(False):
                    memory_rows.append((f"dp=2 {key[0]}", f"{key[1]} worker {snap['rank']}", snap))
    finally:
        group.shutdown()
        group.resource_pool.remove()

    rows = []
    for case, _ in cases:
        costs = [flops.cost(lens) for lens in lengths[args.warmup :]]
        contiguous = plans[case, "contiguous"][args.warmup :]
        base_sync = np.mean([sync_cost(p, c, c0) for p, c in zip(contiguous, costs)])
        base_rank = np.mean([max_rank_cost(p, c, c0) for p, c in zip(contiguous, costs)])
        # No plan beats K * c0 + total / dp with K the fewest micro-batches the case allows.
        bound = np.mean([p.stats["lower_bound"] for p in plans[case, "ours"][args.warmup :]]) / base_sync
        base = samples[case, "contiguous"]
        base_wall = statistics.median(x[0] for x in base)
        base_cpu_sync = statistics.median(x[1] for x in base)
        base_cpu_rank = statistics.median(x[4] for x in base)
        for method in ("contiguous", "ours", "verl"):
            if (case, method) not in plans:
                rows.append((case, method) + ("n/a",) * 10 + ("", note))
                continue
            s = samples[case, method]
            timed = plans[case, method][args.warmup :]
            pred = np.mean([sync_cost(p, c, c0) for p, c in zip(timed, costs)]) / base_sync
            pred_rank = np.mean([max_rank_cost(p, c, c0) for p, c in zip(timed, costs)]) / base_rank
            wall, cpu_sync = statistics.median(x[0] for x in s), statistics.median(x[1] for x in s)
            cpu_rank = statistics.median(x[4] for x in s)
            rows.append(
                (
                    case,
                    method,
                    f"{np.mean([x[3] for x in s]):.2f}",
                    f"{wall:.3f}",
                    f"{wall / base_wall:.3f}",
                    f"{cpu_sync:.3f}",
                    f"{cpu_sync / base_cpu_sync:.3f}",
                    f"{pred:.3f}",
                    f"{cpu_sync / base_cpu_sync / pred:.3f}",
                    f"{cpu_rank / base_cpu_rank:.3f}",
                    f"{pred_rank:.3f}",
                    f"{statistics.median(x[2] for x in s):.3f}",
                    "meas/pred <= 1.05" if case.startswith("fixed") and method == "ours" else "",
                    f"pred bound/contig {bound:.3f} ({flops.name})" if method == "ours" else "",
                )
            )
    return rows


# ---------------------------------------------------------------------- sync table
FSDP_SETTINGS = {
    "per-micro-batch": {},
    "deferred": {"defer_gradient_sync": True},
    "deferred+unsharded": {
        "defer_gradient_sync": True,
        "reshard_after_forward": False,
        "reshard_after_backward": False,
    },
}


def run_sync_bench(args) -> list[tuple]:
    """Tokens/s and peak RSS at dp=2 for each FSDP_SETTINGS entry (see the module docstring)."""
    model_config = ModelConfig.preset(args.model)
    workload = StepWorkload(median=args.median, max_len=args.max_len, seed=2)
    flops = FlopsWorkload.from_model_config(model_config)
    total = args.warmup + args.steps
    batches = make_batches(workload, num=total, vocab_size=model_config.vocab_size)
    plans = [
        plan_balance(seq_lens=seq_lens(b), dp_size=2, micro_batch_size=4, balance=True, workload=flops) for b in batches
    ]
    cluster.start_ray(address=None, num_workers=2 * len(FSDP_SETTINGS))
    groups = {}
    try:
        for name, fsdp in FSDP_SETTINGS.items():
            engine = EngineConfig(optim=OptimConfig(lr=1e-4), attn_impl=args.attn_impl, seed=0, fsdp=FSDPConfig(**fsdp))
            groups[name] = cluster.build_actor_group(
                worker_config=ActorWorkerConfig(model=model_config, engine=engine),
                trainer_cfg=SimpleNamespace(n_gpus_per_node=2, nnodes=1, placement_timeout_s=300.0),
                use_gpu=False,
                worker_cls=BenchActorWorker,
            )
        print(f"[sync] {len(groups)} dp=2 worker groups up", flush=True)
        samples = {name: [] for name in groups}
        names = list(groups)
        for name in names:
            groups[name].memory(True)
        for step in range(total):
            chunks = split_by_plan(Batch.from_dict(tensors=batches[step]), plans[step])
            for name in names[step % len(names) :] + names[: step % len(names)]:
                t0 = time.perf_counter()
                per_rank = groups[name].update_actor(chunks)
                wall = time.perf_counter() - t0
                if step >= args.warmup:
                    cpu_sync = float(np.array([r["bench_micro_cpu"] for r in per_rank]).max(axis=0).sum())
                    samples[name].append((wall, per_rank[0]["perf/tokens"], cpu_sync))
            print(f"[sync] {step + 1}/{total} done", flush=True)
        peaks = {name: max(m["peak_mib"] for m in groups[name].memory(False)) for name in names}
    finally:
        for group in groups.values():
            group.shutdown()
            group.resource_pool.remove()
    base = samples[names[0]]
    base_tps = sum(x[1] for x in base) / sum(x[0] for x in base)
    rows = []
    for name in names:
        s = samples[name]
        tps = sum(x[1] for x in s) / sum(x[0] for x in s)
        rows.append(
            (
                name,
                f"{statistics.median(x[0] for x in s):.3f}",
                f"{tps:.0f}",
                f"{tps / base_tps:.3f}",
                f"{statistics.median(x[2] for x in s):.3f}",
                f"{peaks[name]:.0f}",
                f"{peaks[name] - peaks[names[0]]:+.0f}",
            )
        )
    return rows


# ---------------------------------------------------------------------- overhead table
def _plain_loop_process(
    conn, model_config: ModelConfig, workload: StepWorkload, num: int, lr: float, attn_impl: str
) -> None:
    """A plain PyTorch training loop, one process, one thread; steps on request over ``conn``."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(model_config, attn_impl=attn_impl)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    batches = make_batches(workload, num=num, vocab_size=model_config.vocab_size)
    conn.send(memory_snapshot(reset_peak=True))
    while True:
        request = conn.recv()
        if request is None:
            conn.send(memory_snapshot())
            return
        step, micro_batches = request
        t0, cpu0 = time.perf_counter(), time.process_time()
        tensors = batches[step]
        lengths = tensors["attention_mask"].sum(1)
        num_targets = int(tensors["loss_mask"][:, 1:].sum())
        optimizer.zero_grad(set_to_none=True)
        fb = fb_cpu = 0.0
        for rows in micro_batches:
            rows = torch.as_tensor(rows, dtype=torch.long)
            real = tensors["attention_mask"][rows].bool()
            ids = tensors["input_ids"][rows][real]
            pos = tensors["position_ids"][rows][real]
            # target of packed token t is token t+1 of the same sequence, if it is a loss token
            targets = torch.roll(ids, -1)
            target_mask = torch.roll(tensors["loss_mask"][rows][real].float(), -1)
            cu = torch.zeros(len(rows) + 1, dtype=torch.long)
            cu[1:] = torch.cumsum(lengths[rows], 0)
            target_mask[cu[1:] - 1] = 0.0
            fb, fb_cpu = fb - time.perf_counter(), fb_cpu - time.process_time()
            logits = model(input_ids=ids, position_ids=pos, cu_seqlens=cu, max_seqlen=int(lengths[rows].max()))
            nll = -torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
            ((nll * target_mask).sum() / num_targets).backward()
            fb, fb_cpu = fb + time.perf_counter(), fb_cpu + time.process_time()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        conn.send((time.perf_counter() - t0, time.process_time() - cpu0, fb, fb_cpu))


def run_overhead_bench(args, memory_rows: list) -> list[tuple]:
    from hydra import compose, initialize_config_dir

    from verl_balance.trainer.config import register_schemas
    from verl_balance.trainer.sft_trainer import SFTTrainer

    workload = StepWorkload(median=args.median, max_len=args.max_len, seed=1)
    total = args.warmup + args.steps
    tmp = tempfile.mkdtemp(prefix="vb_overhead_")
    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "verl_balance" / "config"), version_base="1.3"):
        cfg = compose(
            config_name="sft",
            overrides=[
                "trainer.device=cpu",
                "trainer.n_gpus_per_node=1",
                f"model.name={args.model}",
                "data.train_batch_size=32",
                "data.micro_batch_size_per_gpu=4",
                "data.synthetic.num_train=64",
                "data.synthetic.num_val=8",
                f"data.synthetic.out_dir={tmp}/data",
                f"trainer.default_local_dir={tmp}/run",
                "trainer.logger=[jsonl]",
                "trainer.plot=false",
                "trainer.resume_mode=disable",
                f"data.max_length={max(512, args.max_len)}",
            ],
        )
    cluster.start_ray(address=None, num_workers=1)
    start = time.perf_counter()
    trainer = bench_trainer_class(SFTTrainer)(cfg)
    print(f"[overhead] dp=1 SFTTrainer up in {time.perf_counter() - start:.1f} s", flush=True)
    model_config = trainer.model_config
    batches = make_batches(workload, num=total, vocab_size=model_config.vocab_size)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    attn_impl = trainer.actor.describe()[0]["engine"]["attn_impl"]
    # daemon: an error below must not leave the interpreter waiting on it at exit
    proc = ctx.Process(
        target=_plain_loop_process, args=(child, model_config, workload, total, 1e-4, attn_impl), daemon=True
    )
    proc.start()
    plain_start_mem = parent.recv()
    ours, plain, tokens, parts = [], [], [], []
    plain_mem = None
    try:
        trainer.actor.memory(True)
        for step in range(total):
            plan = trainer.plan_mini_batch(Batch.from_dict(tensors=batches[step]))
            parent.send((step, [mb.tolist() for mb in plan.micro_batches[0]]))
            plain_wall, plain_cpu, plain_fb, plain_fb_cpu = parent.recv()
            driver_cpu = time.process_time()
            with _profiled("driver") if step >= args.warmup else contextlib.nullcontext():
                metrics = trainer.train_step(batches[step])
            driver_cpu = time.process_time() - driver_cpu
            if step >= args.warmup:
                plain.append((plain_wall, plain_cpu, plain_fb, plain_fb_cpu))
                ours.append((metrics["timing_s/step"], metrics["train/bench_cpu_time"] + driver_cpu))
                tokens.append(metrics["train/global_tokens"])
                parts.append(
                    (
                        metrics["timing_s/step"] - metrics["train/bench_update_wall"],
                        metrics["train/bench_update_wall"] - metrics["train/bench_compute_wall"],
                        metrics["train/bench_compute_wall"],
                        driver_cpu,
                        metrics["train/bench_compute_cpu"],
                    )
                )
            print(f"[overhead] {step + 1}/{total} done", flush=True)
        worker_mem = trainer.actor.memory(False)[0]
        parent.send(None)
        plain_mem = parent.recv()
    finally:
        proc.join(timeout=60 if plain_mem is not None else 0)
        if proc.is_alive():  # an error above: it still waits for a step request
            proc.terminate()
            proc.join()
        trainer.close()
    if memory_rows is not None:
        memory_rows.append(("dp=1 SFT", "ours: trainer worker", worker_mem))
        memory_rows.append(("dp=1 SFT", "plain loop process", plain_mem))
        print(f"[overhead] plain loop RSS before its first step: {plain_start_mem['rss_mib']:.0f} MiB", flush=True)
    tok = float(np.sum(tokens))
    plain_wall, plain_cpu, _, _ = (float(np.sum(x)) for x in zip(*plain))
    ours_wall, ours_cpu = (float(np.sum(x)) for x in zip(*ours))
    step_ms = 1000 * statistics.median(x[0] for x in ours)
    print(
        "[overhead] ours per step, median ms (share of the median step): "
        + "; ".join(
            f"{name} {1000 * statistics.median(col):.1f} ({1000 * statistics.median(col) / step_ms:.1%})"
            for name, col in zip(
                (
                    "driver + Ray round trip (plan, split, put, call, reply)",
                    "worker outside forward/backward (unpack, pack, optimizer, metrics)",
                    "worker forward+backward",
                    "driver CPU",
                    "worker forward+backward CPU",
                ),
                zip(*parts),
            )
        ),
        flush=True,
    )
    plain_ms = 1000 * statistics.median(x[0] for x in plain)
    plain_fb_ms = 1000 * statistics.median(x[2] for x in plain)
    print(
        f"[overhead] plain loop per step, median ms: forward+backward {plain_fb_ms:.1f} "
        f"({plain_fb_ms / plain_ms:.1%}), its CPU {1000 * statistics.median(x[3] for x in plain):.1f}; "
        f"the rest (packing, clipping, optimizer) {plain_ms - plain_fb_ms:.1f}",
        flush=True,
    )
    return [
        (
            "plain PyTorch loop",
            f"{statistics.median(x[0] for x in plain):.3f}",
            f"{tok / plain_wall:.0f}",
            "1.000",
            "1.000",
            f"{tok / plain_cpu:.0f}",
            "1.000",
            "",
        ),
        (
            "ours: SFTTrainer dp=1",
            f"{statistics.median(x[0] for x in ours):.3f}",
            f"{tok / ours_wall:.0f}",
            f"{plain_wall / ours_wall:.3f}",
            f"{statistics.median(p[0] / o[0] for p, o in zip(plain, ours)):.3f}",
            f"{tok / ours_cpu:.0f}",
            f"{plain_cpu / ours_cpu:.3f}",
            ">= 0.97",
        ),
    ]


# ---------------------------------------------------------------------- output
def print_table(title: str, header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    for line in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench", nargs="?", default="all", choices=("all", "step", "overhead", "memory", "sync"))
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="overhead: cProfile the driver's train_step and the worker's update_actor into DIR/{driver,worker}.prof",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 warm-up + 3 steps, tiny model")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per method first")
    parser.add_argument("--model", default="small", help="ModelConfig preset")
    parser.add_argument("--median", type=int, default=24, help="median sequence length (tokens)")
    parser.add_argument("--max-len", type=int, default=288, help="lengths are clipped to [8, max_len]")
    parser.add_argument("--token-cap", type=int, default=None, help="max_token_len_per_gpu (default: max_len)")
    parser.add_argument("--attn-impl", default="sdpa_loop", help="attention kernel of the step table")
    parser.add_argument(
        "--calibration",
        default=None,
        help="calibration JSON (python -m verl_balance.calibrate): ours plans and predicts with it instead of FLOPs",
    )
    parser.add_argument(
        "--fsdp",
        default="per-micro-batch",
        choices=tuple(FSDP_SETTINGS),
        help="FSDPConfig of the step table's workers (see the sync table)",
    )
    parser.add_argument(
        "--verl-python",
        default=sys.executable,
        help="python of an environment with verl installed (for the verl rows; default: this one)",
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.model = 3, 1, "tiny"
    if args.bench == "memory":
        args.steps = min(args.steps, 3)
    torch.set_num_threads(1)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        os.environ[PROFILE_ENV] = os.path.abspath(args.profile)  # Ray's workers inherit it
    print(
        f"[setup] step-table fsdp={args.fsdp}; model={args.model} "
        f"lengths lognormal(median {args.median}, sigma 1.2) clipped to "
        f"[8, {args.max_len}], 32 per step; {args.warmup} warm-up + {args.steps} timed steps per method; "
        f"cores {os.cpu_count()}, load {os.getloadavg()}",
        flush=True,
    )

    memory_rows = [] if args.bench in ("all", "memory") else None
    step_rows = run_step_bench(args, memory_rows) if args.bench in ("all", "step", "memory") else None
    overhead_rows = run_overhead_bench(args, memory_rows) if args.bench in ("all", "overhead", "memory") else None
    sync_rows = run_sync_bench(args) if args.bench in ("all", "sync") else None

    if step_rows is not None and args.bench != "memory":
        print_table(
            "Step time, dp=2 CPU workers (medians over timed steps; x/contig = relative to the contiguous split)",
            (
                "case",
                "plan",
                "micro/rank",
                "wall [s]",
                "wall/contig",
                "cpu sync [s]",
                "cpu sync/contig",
                "pred sync/contig",
                "meas/pred",
                "cpu rank/contig",
                "pred rank/contig",
                "cpu max-rank [s]",
                "target",
                "note",
            ),
            step_rows,
        )
    if overhead_rows is not None and args.bench != "memory":
        print_table(
            "Framework overhead, dp=1 (tokens/s over timed steps; tokens/cpu-s counts ours' worker + "
            "driver CPU; ratios = ours / plain; median step ratio = median over steps of plain / ours of the same "
            "batch, robust to a step slowed by other load)",
            ("path", "median step [s]", "tokens/s", "ratio", "median step ratio", "tokens/cpu-s", "cpu ratio")
            + ("target",),
            overhead_rows,
        )
    if sync_rows is not None:
        print_table(
            "FSDP2 gradient accumulation, dp=2, fixed micro-batches (4 per rank), balanced plans "
            "(tokens/s over timed steps; ratio = / per-micro-batch sync; peak = max VmHWM of the group's "
            "workers since before the first step)",
            ("fsdp", "median step [s]", "tokens/s", "ratio", "cpu sync [s]", "peak RSS [MiB]", "vs per-mb [MiB]"),
            sync_rows,
        )
    if memory_rows:
        print_table(
            "Peak memory (MiB): peak = VmHWM since reset before the measured steps; lifetime = getrusage ru_maxrss",
            ("layout", "process", "rss now", "peak", "lifetime peak"),
            [
                (a, b, f"{m['rss_mib']:.0f}", f"{m['peak_mib']:.0f}", f"{m['maxrss_mib']:.0f}")
                for a, b, m in memory_rows
            ],
        )
    print(f"\nload average (1, 5, 15 min) after the run: {os.getloadavg()}; cores: {os.cpu_count()}")


if __name__ == "__main__":
    main()
