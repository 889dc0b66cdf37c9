"""Helpers for the trainer tests (the Ray fixture lives in tests/conftest.py)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path

import pytest

from verl_balance.testing.forked_workers import python_command

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "verl_balance" / "config"


def compose_config(name: str, overrides: list[str]):
    """The recipe config exactly as the command line would build it (Hydra compose API, after the
    command line's own step: verl's keys written for Hydra to add, ``verl_keys.command_line``)."""
    from hydra import compose, initialize_config_dir

    from verl_balance.trainer.config import register_schemas
    from verl_balance.trainer.config.verl_keys import command_line

    register_schemas()
    args, _ = command_line(overrides, recipe=name)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=args)


def run_trainer(trainer, *, stop_after: int | None = None) -> list[dict]:
    """``trainer.fit()`` (then ``close``); with ``stop_after=k`` a Ctrl-C arrives during step k
    (handled after it: save, exit). Returns the run's metrics records."""
    return fit_trainer(trainer, stop_after=stop_after)[1]


def fit_trainer(trainer, *, stop_after: int | None = None) -> tuple[dict, list[dict]]:
    """``run_trainer`` that also returns the summary of ``fit()``: (summary, metrics records)."""
    from verl_balance.utils.tracking import read_metrics

    if stop_after is not None:
        step = trainer.train_step

        def train_step_then_interrupt(batch):
            metrics = step(batch)
            if trainer.global_step + 1 == stop_after:
                os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does: handled after this step
            return metrics

        trainer.train_step = train_step_then_interrupt
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return summary, read_metrics(os.path.join(trainer.cfg.trainer.default_local_dir, "metrics.jsonl"))


def train_sft(overrides: list[str], *, stop_after: int | None = None) -> list[dict]:
    """Run the SFT recipe with ``overrides`` (``run_trainer``: ``stop_after=k`` sends a Ctrl-C
    during step k). Returns the run's metrics records."""
    from verl_balance.trainer.sft_trainer import SFTTrainer

    return run_trainer(SFTTrainer(compose_config("sft", overrides)), stop_after=stop_after)


def run_cli_in_process(module: str, args: list[str], *, monkeypatch, capsys) -> tuple[int, str]:
    """``python -m <module> <args>`` run in this process as ``python -m`` runs it (runpy), with Ray's
    start-up replaced by a failure (these are early errors): (exit code, stderr). One interpreter start
    less than a subprocess; the process-level exit (code 2, one line, no traceback) is shown by the
    subprocess in tests/trainer/test_day_to_day.py::test_cli_typo_and_bad_value_are_one_line_exit_2."""
    import runpy

    from verl_balance.trainer import cluster

    def started(**kwargs):
        raise AssertionError("Ray was started before the error")

    monkeypatch.setattr(cluster, "start_ray", started)
    monkeypatch.setattr("sys.argv", [module.rsplit(".", 1)[-1], *args])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    capsys.readouterr()
    # Hydra points the root logger's handlers at this test's captured streams, which pytest closes
    # afterwards: the next test logging through root would hit a closed file. Restore them.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        runpy.run_module(module, run_name="__main__")
    except SystemExit as exit_info:
        code = exit_info.code if isinstance(exit_info.code, int) else 1
    else:
        code = 0
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return code, capsys.readouterr().err


@pytest.fixture
def tiny_sft_overrides(tmp_path) -> list[str]:
    """A small, fast SFT setup on the synthetic task, shared data dir per test."""
    return [
        "trainer.device=cpu",
        "model.name=tiny",
        "data.train_batch_size=16",
        "data.synthetic.num_train=128",
        "data.synthetic.num_val=32",
        f"data.synthetic.out_dir={tmp_path / 'data'}",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.resume_mode=disable",
    ]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> str:
    """A tiny random qwen2 directory with its locally trained tokenizer and chat template."""
    from verl_balance.models.tiny_hf import main as tiny_hf_main

    out = tmp_path_factory.mktemp("tiny_qwen2") / "model"
    tiny_hf_main(["--family", "qwen2", "--out", str(out)])
    return str(out)


def straight_and_resumed_runs(base: list[str], root) -> dict:
    """The SFT recipe run straight through, and the same run stopped by Ctrl-C during step 2 and
    resumed in its directory: {"root", "straight", "first", "resumed"} metrics records."""
    straight = train_sft(base + [f"trainer.default_local_dir={root / 'straight'}", "trainer.resume_mode=disable"])
    resumed_dir = root / "resumed"
    first = train_sft(base + [f"trainer.default_local_dir={resumed_dir}", "trainer.resume_mode=auto"], stop_after=2)
    resumed = train_sft(base + [f"trainer.default_local_dir={resumed_dir}", "trainer.resume_mode=auto"])
    return {"root": root, "straight": straight, "first": first, "resumed": resumed}


def sft_reference_overrides(root) -> list[str]:
    """The 2-worker tiny SFT config of ``sft_reference_runs`` (checkpoints at steps 2 and 4, each with
    its Hugging Face export in hf/), data under ``root``; without ``trainer.default_local_dir`` and
    ``trainer.resume_mode``."""
    return [
        "trainer.device=cpu",
        "model.name=tiny",
        "data.train_batch_size=16",
        "data.synthetic.num_train=128",
        "data.synthetic.num_val=32",
        f"data.synthetic.out_dir={root / 'data'}",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.save_hf_model=true",
        "optim.lr=3e-3",
    ]


@pytest.fixture(scope="session")
def sft_reference_runs(ray_cluster, tmp_path_factory) -> dict:
    """One SFT config (``sft_reference_overrides``) run straight through, and stopped by Ctrl-C
    during step 3 (not a ``save_freq`` step: only the stop saves it) and resumed in its directory;
    each run is (summary, metrics records). Shared by the resume, summary, verified-checkpoint,
    checkpoint-trust, worker-restart and built-in HF export tests, so its trainers start once per
    session: a test that changes a run directory works on a copy. Keys: "root", "base", "straight",
    "first", "latest_after_first" (latest_checkpointed_iteration.txt after the stop), "resumed"; the
    run directories are root/"straight" and root/"resumed"."""
    from verl_balance.trainer.sft_trainer import SFTTrainer

    root = tmp_path_factory.mktemp("sft_reference")
    base = sft_reference_overrides(root)

    def fit(name: str, resume_mode: str, stop_after: int | None = None):
        overrides = base + [f"trainer.default_local_dir={root / name}", f"trainer.resume_mode={resume_mode}"]
        return fit_trainer(SFTTrainer(compose_config("sft", overrides)), stop_after=stop_after)

    straight = fit("straight", "disable")
    first = fit("resumed", "auto", stop_after=3)
    latest_after_first = (root / "resumed" / "latest_checkpointed_iteration.txt").read_text()
    resumed = fit("resumed", "auto")
    return {
        "root": root,
        "base": base,
        "straight": straight,
        "first": first,
        "latest_after_first": latest_after_first,
        "resumed": resumed,
    }


@pytest.fixture(scope="session")
def cli_sft_run(tmp_path_factory) -> dict:
    """One real ``python -m verl_balance.main_sft`` run with the default console (2 workers, 4 steps,
    validation and checkpoints at steps 2 and 4) on a fresh embedded Ray cluster, started in an empty
    working directory: {"proc": the CompletedProcess, "cwd", "run_dir"}. Checked by the day-to-day
    console test and the run-log location test."""
    root = tmp_path_factory.mktemp("cli_sft_run")
    cwd, run_dir = root / "cwd", root / "run"
    cwd.mkdir()
    python_path = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        python_command(
            [
                "-m",
                "verl_balance.main_sft",
                "trainer.device=cpu",
                "trainer.n_gpus_per_node=2",
                "data.train_batch_size=16",
                "data.synthetic.num_train=64",
                "data.synthetic.num_val=16",
                f"data.synthetic.out_dir={root / 'data'}",
                "trainer.test_freq=2",
                "trainer.save_freq=2",
                "trainer.plot=false",
                f"trainer.default_local_dir={run_dir}",
            ]
        ),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        # a fresh embedded cluster, never a running one
        env={**os.environ, "PYTHONPATH": python_path, "RAY_ADDRESS": "local"},
    )
    return {"proc": proc, "cwd": cwd, "run_dir": run_dir}


def hf_grpo_run(model_dir: str, root, extra: list[str]) -> list[dict]:
    """2 GRPO steps (validation at step 2) of the tiny HF model ``model_dir`` on 2 workers, data and
    run under ``root``, ``extra`` overrides last; returns the run's metrics records."""
    from verl_balance.trainer.config.grpo import register_grpo_schema
    from verl_balance.trainer.grpo.trainer import GRPOTrainer
    from verl_balance.utils.tracking import read_metrics

    register_grpo_schema()
    cfg = compose_config(
        "grpo",
        [
            "trainer.device=cpu",
            "trainer.n_gpus_per_node=2",
            "trainer.logger=[jsonl]",
            "trainer.plot=false",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={root / 'run'}",
            f"actor_rollout_ref.model.path={model_dir}",
            "data.synthetic.num_train=64",
            "data.synthetic.num_val=4",
            f"data.synthetic.out_dir={root / 'data'}",
            "data.synthetic.tasks=[copy]",
            "data.synthetic.max_size=6",
            "data.max_prompt_length=64",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.optim.lr=5e-2",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.rollout.response_length=8",
            "actor_rollout_ref.actor.use_kl_loss=true",
            # A random tiny model earns no reward (zero advantages): the entropy bonus makes the
            # adapters move anyway, so the KL to the base model is exercised.
            "actor_rollout_ref.actor.entropy_coeff=0.1",
            "trainer.total_training_steps=2",
            "trainer.test_freq=2",
            *extra,
        ],
    )
    trainer = GRPOTrainer(cfg)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return read_metrics(summary["metrics"])


@pytest.fixture(scope="session")
def hf_grpo_runs(ray_cluster, tmp_path_factory) -> dict:
    """``hf_grpo_run`` on a tiny random qwen2 directory with LoRA (rank 8) and with full fine-tuning:
    {"model_dir", "lora": records, "full": records}. Shared by the LoRA GRPO tests and the HF GRPO
    end-to-end test, so these trainers start once per session."""
    from verl_balance.models.tiny_hf import main as tiny_hf_main

    model_dir = str(tmp_path_factory.mktemp("grpo_tiny_qwen2") / "model")
    tiny_hf_main(["--family", "qwen2", "--out", model_dir])
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
    return {
        "model_dir": model_dir,
        "lora": hf_grpo_run(model_dir, tmp_path_factory.mktemp("grpo_lora"), lora),
        "full": hf_grpo_run(model_dir, tmp_path_factory.mktemp("grpo_full"), []),
    }


def hf_sft_overrides(model_dir: str, root, *, lr: float) -> list[str]:
    """SFT on a tiny HF model directory with synthetic data under ``root``, jsonl metrics only."""
    return [
        "trainer.device=cpu",
        f"model.path={model_dir}",
        "data.train_batch_size=16",
        "data.synthetic.num_train=128",
        "data.synthetic.num_val=16",
        f"data.synthetic.out_dir={root / 'data'}",
        "data.max_length=256",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        f"optim.lr={lr}",
        "optim.warmup_steps_ratio=0.0",
    ]
