"""A driver that fails while its workers are alive shuts them down and exits non-zero, never hangs:
an exception in a step, and a stopped (SIGSTOP) worker that the call timeout catches (heartbeat
lines naming the rank first). Each run is a subprocess with its own embedded Ray, under a timeout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
import time

import pytest

from verl_balance.testing.forked_workers import python_command

pytestmark = pytest.mark.slow  # a subprocess with Ray workers

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = textwrap.dedent(
    """
    import json, logging, os, signal, sys
    import ray
    from tests.trainer.conftest import compose_config
    from verl_balance.trainer.sft_trainer import SFTTrainer

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    mode, tmp = sys.argv[1], sys.argv[2]
    cfg = compose_config("sft", [
        "trainer.device=cpu", "model.name=tiny", "trainer.n_gpus_per_node=2", "data.train_batch_size=8",
        "data.synthetic.num_train=64", "data.synthetic.num_val=8", f"data.synthetic.out_dir={tmp}/data",
        "trainer.logger=[jsonl]", "trainer.plot=false", f"trainer.default_local_dir={tmp}/run",
        "trainer.resume_mode=disable", "trainer.worker_call_timeout_s=8", "trainer.heartbeat_interval_s=2",
    ])

    class Failing(SFTTrainer):
        def train_step(self, item):
            metrics = super().train_step(item)
            pids = [ray.get(w.__ray_call__.remote(lambda self: os.getpid())) for w in self.actor.workers]
            with open(os.path.join(tmp, "pids.json"), "w") as f:
                json.dump(pids, f)
            if mode == "raise":
                raise RuntimeError("driver bug after step 1")
            logging.getLogger("driver_exit_test").info("SIGSTOP to rank 1")
            os.kill(pids[1], signal.SIGSTOP)  # mode "stop": the next call waits on a stopped rank 1
            return metrics

    Failing.train(cfg)
    """
)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["raise", "stop"])
def test_failing_driver_stops_its_workers_and_exits_nonzero(mode, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    python_path = os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}
    command = python_command([str(script), mode, str(tmp_path)])
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    if mode == "raise":
        assert "RuntimeError: driver bug after step 1" in output, output[-3000:]
    else:
        # rank 0 waits in a collective with the stopped rank 1: both are named, rank 1's state says why. Only
        # the heartbeats after the stop count: a loaded machine can make step 1's call beat as well.
        stopped = json.loads((tmp_path / "pids.json").read_text())[1]
        log = proc.stderr.splitlines()
        after_stop = log[next(i for i, line in enumerate(log) if "SIGSTOP to rank 1" in line) :]
        beats = [line for line in after_stop if "still waiting for ActorWorker.update_actor" in line]
        assert beats and all(f"pid {stopped} stopped" in line for line in beats), output[-3000:]
        assert re.search(
            r"WorkerTimeoutError: ActorWorker.update_actor: worker rank\(s\) \[(0, )?1\] did not finish "
            rf"within 8 s .*pid {stopped} stopped.*trainer.worker_call_timeout_s",
            output,
        ), output[-3000:]
    pids = json.loads((tmp_path / "pids.json").read_text())
    deadline = time.monotonic() + 30  # Ray reaps its workers asynchronously
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(map(_alive, pids)), f"workers {pids} survived the driver"
