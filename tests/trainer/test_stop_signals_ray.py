"""Stop signals with Ray workers (slow; issue 50).

- The last-step rule: a signal that arrives during the run's last step lets the step finish and
  save, and the run exits 0 (it finished its steps; docs/fault_tolerance.md, 'Exit codes'). A
  signal during an earlier step exits 143 (test_checkpoint_trust_ray.py, the reference).
- SIGTERM to the whole process group, as SLURM sends it, through the CLI: the embedded Ray
  cluster's processes and the workers ignore it (they were started with the stop signals
  blocked), so the driver saves the step in flight and exits 143. Before, Ray's daemons died with
  the group and the save failed ("Failed to connect to GCS"), rc 1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.trainer.conftest import compose_config, fit_trainer, sft_reference_overrides
from verl_balance.trainer.checkpoint import COMPLETE_FILE
from verl_balance.trainer.driver import exit_code

pytestmark = pytest.mark.slow  # Ray workers

SMALL = ["trainer.n_gpus_per_node=1", "trainer.save_hf_model=false", "trainer.save_freq=-1"]


def _overrides(root, *extra: str) -> list[str]:
    """``sft_reference_overrides`` with ``SMALL`` and ``extra`` replacing its keys (the CLI refuses a
    key given twice)."""
    mine = [*SMALL, *extra]
    keys = {o.split("=", 1)[0] for o in mine}
    return [o for o in sft_reference_overrides(root) if o.split("=", 1)[0] not in keys] + mine


def test_a_signal_during_the_last_step_saves_it_and_exits_0(ray_cluster, tmp_path):
    from verl_balance.trainer.sft_trainer import SFTTrainer

    overrides = _overrides(tmp_path, "trainer.total_training_steps=2", f"trainer.default_local_dir={tmp_path / 'run'}")
    trainer = SFTTrainer(compose_config("sft", overrides))
    step = trainer.train_step

    def last_step_then_sigterm(batch):
        metrics = step(batch)
        if trainer.global_step + 1 == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return metrics

    trainer.train_step = last_step_then_sigterm
    summary, records = fit_trainer(trainer)
    assert [r["step"] for r in records] == [1, 2]
    assert summary["stop_signal"] is None and exit_code(summary) == 0
    assert os.path.isfile(tmp_path / "run" / "global_step_2" / COMPLETE_FILE)


def test_a_process_group_sigterm_saves_the_step_in_flight_and_exits_143(tmp_path):
    run_dir = tmp_path / "run"
    args = _overrides(tmp_path, "trainer.total_training_steps=400", f"trainer.default_local_dir={run_dir}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "verl_balance.main_sft", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, as a SLURM job step is
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.5)
        assert proc.poll() is None, f"the run ended before the signal: {proc.communicate()[0][-3000:]}"
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, output[-3000:]
    assert "Failed to connect to GCS" not in output
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    saved = max(int(p.name.split("_")[-1]) for p in run_dir.glob("global_step_*"))
    assert saved == steps[-1] >= 2 and (run_dir / f"global_step_{saved}" / COMPLETE_FILE).is_file()
