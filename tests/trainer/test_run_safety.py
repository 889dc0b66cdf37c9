"""One live run per directory, resume changes applied or refused, non-finite guards and clear
lineage / permission errors, without Ray (docs/fault_tolerance.md).

References are hand-worked: the owner a lock message must name, the learning rate the cosine
formula gives at a step, which key a refused resume must name.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from tests.trainer.conftest import compose_config
from tests.trainer.test_reliability import CONFIG, FakeGroup, _run, _steps
from verl_balance.engine.config import EngineConfig, OptimConfig
from verl_balance.engine.optim import apply_optim_config, build_optimizer
from verl_balance.trainer import checkpoint
from verl_balance.trainer.checkpoint import (
    LINEAGE_FILE,
    CheckpointError,
    LineageFileError,
    ResumeKeyChangedError,
    save_trainer_checkpoint,
    start_run,
)
from verl_balance.trainer.checkpoint.resume_policy import ResumeConfigError, policy_table, resume_policies
from verl_balance.trainer.checkpoint.run_lock import LOCK_FILE, RunDirectoryBusyError, acquire_run_lock
from verl_balance.trainer.config import ConfigError, SFTConfig, validate_sft

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HOLDER = (
    "import sys, time; from verl_balance.trainer.checkpoint.run_lock import acquire_run_lock; "
    "lock = acquire_run_lock(sys.argv[1]); print('locked', flush=True); time.sleep(600)"
)


def _lock_holder(root) -> subprocess.Popen:
    """Another process that takes the run lock of ``root`` and keeps it until killed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


# ---------------------------------------------------------------------- 1. one live run per directory
@pytest.mark.slow  # a second interpreter
def test_a_second_run_is_refused_naming_the_directory_and_the_live_owner_and_a_killed_owner_never_blocks(tmp_path):
    root = tmp_path / "run"
    holder = _lock_holder(root)
    try:
        with pytest.raises(RunDirectoryBusyError) as info:
            acquire_run_lock(str(root))
        message = str(info.value)
        assert isinstance(info.value, ValueError)
        assert f"trainer.default_local_dir='{root}'" in message
        assert f"pid {holder.pid} on host" in message and "started 20" in message
        assert os.listdir(root) == [LOCK_FILE], "the refused run wrote nothing"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (root / LOCK_FILE).exists(), "the dead owner's lock file is still there"
    lock = acquire_run_lock(str(root))  # ...and does not block: the kernel released the lock
    assert json.loads((root / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_the_lock_is_per_run_within_one_process_and_free_again_once_released(tmp_path):
    first = acquire_run_lock(str(tmp_path))
    with pytest.raises(RunDirectoryBusyError, match=rf"pid {os.getpid()}"):
        acquire_run_lock(str(tmp_path))
    first.release()
    acquire_run_lock(str(tmp_path)).release()  # negative control: a released directory is free


# ---------------------------------------------------------------------- 2. resume: applied or refused
@pytest.mark.parametrize(
    "changed, key, shown",
    [
        ({"trainer": {"seed": 2, "save_freq": 2}}, "trainer.seed", "trainer.seed: 1 -> 2"),
        ({"model": {"name": "small"}}, "model.name", "model.name: 'tiny' -> 'small'"),
    ],
)
def test_resume_changing_a_refused_key_fails_naming_the_key_old_and_new_value(tmp_path, changed, key, shown):
    _run(tmp_path, saves=[2])
    with pytest.raises(ResumeKeyChangedError) as info:
        _run(tmp_path, "auto", config={**CONFIG, **changed})
    assert isinstance(info.value, ResumeConfigError) and key in str(info.value) and shown in str(info.value)
    assert json.loads((tmp_path / LINEAGE_FILE).read_text())["config"] == CONFIG, "the lineage record is untouched"


def test_resume_may_change_layout_and_applied_keys_and_a_new_lineage_may_change_anything(tmp_path):
    _run(tmp_path, saves=[2])
    layout = {**CONFIG, "data": {"micro_batch_size_per_gpu": 1}, "ulysses_sequence_parallel_size": 2}
    _, path = _run(tmp_path, "auto", config=layout)
    assert path == str(tmp_path / "global_step_2")
    # resume_path / disable start a new lineage: not a resume of this one.
    _run(tmp_path, "disable", config={**CONFIG, "trainer": {"seed": 5, "save_freq": 2}})


def test_an_auto_run_with_no_saved_state_yet_may_change_any_key(tmp_path):
    _run(tmp_path)  # killed before its first save
    _, path = _run(tmp_path, "auto", config={**CONFIG, "model": {"name": "small"}})
    assert path is None


def test_docs_table_of_resume_keys_is_the_one_generated_from_the_schema_metadata():
    from verl_balance.trainer.config.grpo import GRPOConfig

    table = policy_table({"sft": SFTConfig, "grpo": GRPOConfig})
    with open(os.path.join(REPO_ROOT, "docs", "fault_tolerance.md"), encoding="utf-8") as f:
        doc = f.read()
    block = re.search(r"<!-- resume-keys:begin -->\n(.*?)\n<!-- resume-keys:end -->", doc, re.S)
    assert block is not None, "docs/fault_tolerance.md lacks the resume-keys table markers"
    assert block.group(1).strip() == table, "regenerate the table with resume_policy.policy_table"
    policies = resume_policies(SFTConfig)
    assert policies["optim.lr"] == "apply" and policies["trainer.seed"] == "refuse"
    assert policies["data.micro_batch_size_per_gpu"] == "layout" and policies["model.fsdp_config"] == "layout"


def _cosine_lr(lr: float, step: int, total: int) -> float:
    """Hand formula: cosine from lr to 0 over ``total`` steps, no warmup, for 0-based step ``step``."""
    return lr * 0.5 * (1 + math.cos(math.pi * step / total))


def test_a_restored_optimizer_uses_the_new_lr_and_schedule_from_the_next_step():
    def engine_config(lr):
        return EngineConfig(optim=OptimConfig(lr=lr, lr_scheduler="cosine", weight_decay=0.0), total_steps=6)

    def optimizer(config):
        torch.manual_seed(0)
        return build_optimizer([torch.nn.Parameter(torch.randn(4))], config=config)

    old_opt, old_sched = optimizer(engine_config(1e-3))
    for _ in range(2):
        old_opt.param_groups[0]["params"][0].grad = torch.ones(4)
        old_opt.step()
        old_sched.step()
    saved = (old_opt.state_dict(), old_sched.state_dict())

    new_config = engine_config(1e-4)
    opt, sched = optimizer(new_config)
    opt.load_state_dict(saved[0])
    sched.load_state_dict(saved[1])
    # Negative control: loading alone keeps the old run's rate (the reported bug).
    assert sched.get_last_lr()[0] == pytest.approx(_cosine_lr(1e-3, 2, 6))
    apply_optim_config(opt, sched, config=new_config)
    assert sched.get_last_lr()[0] == pytest.approx(_cosine_lr(1e-4, 2, 6))
    assert opt.param_groups[0]["lr"] == pytest.approx(_cosine_lr(1e-4, 2, 6))
    opt.param_groups[0]["params"][0].grad = torch.ones(4)
    opt.step()
    sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(_cosine_lr(1e-4, 3, 6))
    assert opt.state[opt.param_groups[0]["params"][0]]["step"] == 3, "the Adam state stays restored"


# ---------------------------------------------------------------------- 3. non-finite values
@pytest.mark.parametrize(
    "recipe, override, key",
    [
        ("sft", "optim.lr=inf", "optim.lr=inf"),
        ("sft", "optim.clip_grad=inf", "optim.clip_grad=inf"),
        ("grpo", "actor_rollout_ref.actor.optim.lr=inf", "actor_rollout_ref.actor.optim.lr=inf"),
        ("grpo", "actor_rollout_ref.rollout.temperature=nan", "actor_rollout_ref.rollout.temperature=nan"),
    ],
)
def test_a_non_finite_config_value_is_rejected_at_startup_naming_the_key(tmp_path, recipe, override, key):
    if recipe == "grpo":
        from verl_balance.trainer.config.grpo import register_grpo_schema
        from verl_balance.trainer.config.grpo import validate_grpo as validate

        register_grpo_schema()
    else:
        validate = validate_sft
    base = [f"trainer.default_local_dir={tmp_path / 'run'}"]
    validate(compose_config(recipe, base))  # negative control: the recipe's defaults pass
    with pytest.raises(ConfigError, match=re.escape(key)):
        validate(compose_config(recipe, base + [override]))


# ---------------------------------------------------------------------- 8. clear errors
@pytest.mark.parametrize(
    "content, expected",
    [
        ("{}", r"lacks the key\(s\) \['lineage_id'"),
        ('{"lineage_id": "a", "run_id"', "cannot be read as JSON"),
        ("", "cannot be read as JSON"),
        ("[1, 2]", "holds a list, not a JSON object"),
    ],
)
def test_a_broken_lineage_file_is_an_error_naming_the_file_and_the_fault(tmp_path, content, expected):
    _run(tmp_path, saves=[2])
    (tmp_path / LINEAGE_FILE).write_text(content)
    with pytest.raises(LineageFileError, match=expected) as info:
        _run(tmp_path, "auto")
    assert str(tmp_path / LINEAGE_FILE) in str(info.value) and "resume_mode=disable" in str(info.value)
    identity, path = _run(tmp_path, "disable")  # the suggested way out works and keeps the old files
    assert path is None and _steps(tmp_path) == []
    assert json.loads((tmp_path / LINEAGE_FILE).read_text())["lineage_id"] == identity.lineage_id


def test_permission_denied_during_a_save_names_default_local_dir_not_the_staging_path(tmp_path):
    identity, _ = _run(tmp_path, saves=[2])
    staging = tmp_path / ".staging_global_step_4" / "shard.txt"
    error = PermissionError(13, "Permission denied", str(staging))
    with pytest.raises(CheckpointError) as info:
        save_trainer_checkpoint(FakeGroup(error=error), root=str(tmp_path), step=4, trainer_state={}, identity=identity)
    message = str(info.value)
    assert f"trainer.default_local_dir='{tmp_path}'" in message and "step 4" in message
    assert ".staging_" not in message
    assert _steps(tmp_path) == [2] and checkpoint.is_complete(str(tmp_path / "global_step_2"))
    # Negative control: an unrelated error keeps its own type and message.
    with pytest.raises(RuntimeError, match="worker stopped") as other:
        save_trainer_checkpoint(
            FakeGroup(fail_after_shard=True), root=str(tmp_path), step=4, trainer_state={}, identity=identity
        )
    assert not isinstance(other.value, CheckpointError)


def test_start_run_refuses_nothing_with_an_unchanged_config(tmp_path):
    identity, _ = _run(tmp_path, saves=[2])
    again, path = start_run(str(tmp_path), resume_mode="auto", resume_from_path=None, config=CONFIG)
    assert path == str(tmp_path / "global_step_2") and again.lineage_id == identity.lineage_id


def test_a_trainer_that_fails_during_set_up_releases_the_run_directory(tmp_path):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    root = tmp_path / "run"
    cfg = compose_config(
        "sft", [f"trainer.default_local_dir={root}", f"data.train_files={tmp_path / 'missing.parquet'}"]
    )
    with pytest.raises(Exception) as info:  # the missing data file, after the directory was locked
        SFTTrainer(cfg)
    assert (root / LOCK_FILE).exists(), str(info.value)
    acquire_run_lock(str(root)).release()  # free, although `info` still references the half-built trainer


@pytest.mark.slow  # the lock holder is a second interpreter; the CLI runs in this process
def test_the_cli_refuses_a_directory_another_live_process_holds_at_once_naming_it(tmp_path, monkeypatch, capsys):
    from tests.trainer.conftest import run_cli_in_process

    root = tmp_path / "run"
    holder = _lock_holder(root)
    monkeypatch.chdir(tmp_path)
    try:
        code, stderr = run_cli_in_process(
            "verl_balance.main_sft",
            ["trainer.device=cpu", f"trainer.default_local_dir={root}"],
            monkeypatch=monkeypatch,
            capsys=capsys,
        )
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert code == 2, stderr[-2000:]  # a user error: one line, exit code 2, no traceback
    assert "is in use by another live run" in stderr and f"pid {holder.pid} on host" in stderr, stderr
    assert "Traceback" not in stderr, stderr[-2000:]
    assert sorted(os.listdir(root)) == [LOCK_FILE], "the refused run wrote nothing there (no log, data, lineage)"


def test_retention_never_deletes_the_protected_last_finite_checkpoint(tmp_path):
    identity, _ = _run(tmp_path, saves=[1, 2], keep=1)
    assert _steps(tmp_path) == [2]
    save_trainer_checkpoint(
        FakeGroup(),
        root=str(tmp_path),
        step=3,
        trainer_state={},
        identity=identity,
        max_to_keep=1,
        protect=str(tmp_path / "global_step_2"),
    )
    assert _steps(tmp_path) == [2, 3], "the protected checkpoint stays beyond max_ckpt_to_keep"
    save_trainer_checkpoint(FakeGroup(), root=str(tmp_path), step=4, trainer_state={}, identity=identity, max_to_keep=1)
    assert _steps(tmp_path) == [4], "negative control: without protection only the newest is kept"
