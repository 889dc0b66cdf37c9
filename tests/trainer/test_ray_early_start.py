"""The recipes' early Ray start (``trainer/ray_start.py``): the embedded cluster starts in a background
thread at process start and ``cluster.start_ray`` takes it only when the config asks for exactly its
arguments; a cluster asked for otherwise is started anew. The cluster outlives the thread's start (Ray ties
its processes to the starting thread), and a driver stopped by a config error leaves no Ray process behind.
Each case runs in its own interpreter under its own ``RAY_TMPDIR``: this process may hold the session's cluster."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from verl_balance.single_controller import forked_workers
from verl_balance.trainer import ray_start

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_EMBEDDED_EARLY = ray_start.start_embedded_early  # tests/conftest.py stubs it in every test of this process

pytestmark = pytest.mark.slow

TAKE_OR_RESTART = """
import sys, time, ray
from verl_balance.trainer import cluster, ray_start

ray_init = {"num_cpus": 3} if sys.argv[1] == "other" else None
assert ray_start.start_embedded_early([])
assert not ray_start.start_embedded_early([])  # one early start per process
time.sleep(1.0)  # the import of the config's modules, in a real driver
_, wanted = cluster.ray_init_arguments(address=None, ray_init=ray_init)
taken = ray_start.take_early_start(wanted)
print("taken", taken, "initialized", ray.is_initialized(), flush=True)
cluster.start_ray(address=None, ray_init=ray_init)
time.sleep(2.0)  # the starting thread's start returned long ago: its processes must still run

@ray.remote(num_cpus=1)
def square(x):
    return x * x

print("square", ray.get(square.remote(7), timeout=120), "cpus", ray.cluster_resources()["CPU"], flush=True)
"""


def _run(
    argv: list[str], tmp: str, *, timeout: float = 300, unset: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])}
    for name in ("RAY_ADDRESS", *unset):
        env.pop(name, None)
    env["RAY_TMPDIR"] = tmp
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)


def _ray_processes_under(tmp: str) -> list[str]:
    """Command lines of the live processes that name ``tmp`` (Ray's daemons carry their session directory)."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if tmp in line and "ps -eo" not in line]


@pytest.fixture
def ray_tmp():
    tmp = tempfile.mkdtemp(prefix="res", dir="/tmp")  # Ray's socket paths must stay short
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def test_the_early_cluster_is_taken_when_the_config_asks_for_its_arguments_and_outlives_its_thread(ray_tmp):
    proc = _run(["-c", TAKE_OR_RESTART, "same"], ray_tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "taken True initialized True" in proc.stdout
    assert f"square 49 cpus {float(ray_start.embedded_cluster_cpus())}" in proc.stdout
    assert "Started a local Ray instance" not in proc.stderr  # the early start's announcement is dropped


def test_another_ray_init_shuts_the_early_cluster_down_and_starts_the_one_asked_for(ray_tmp):
    proc = _run(["-c", TAKE_OR_RESTART, "other"], ray_tmp)  # negative control of the case above
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "taken False initialized False" in proc.stdout
    assert "square 49 cpus 3.0" in proc.stdout


def test_a_config_error_after_the_early_start_exits_2_and_leaves_no_ray_process(ray_tmp):
    proc = _run(["-m", "verl_balance.main_sft", "trainer.device=cpu", "trainer.totl_epochs=2"], ray_tmp)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "did you mean 'trainer.total_epochs'" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr and "Started a local Ray instance" not in proc.stderr
    assert os.listdir(ray_tmp), "the early start made no Ray session under RAY_TMPDIR"  # it did start
    deadline = time.monotonic() + 10
    while _ray_processes_under(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ray_processes_under(ray_tmp) == []


INTERRUPTED_START = """
import os, signal, sys, tempfile, time
from verl_balance.trainer import ray_start

tempfile.tempdir = os.getcwd()  # the preload server's folder lands here, where the test looks for leftovers

signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, also under a suite started in the background
guarded = sys.argv[2] == "guarded"
with ray_start.stops_at_once_before_the_run() if guarded else open(os.devnull):
    assert ray_start.start_embedded_early(["trainer.device=cpu"])
    time.sleep(1.0)  # the cluster's daemons are starting: the imports of a real driver
    os.kill(os.getpid(), int(sys.argv[1]))
    time.sleep(60)
print("finished", flush=True)
"""


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_stop_signal_while_the_early_start_runs_exits_with_its_code_in_one_line_leaving_no_ray_process(
    ray_tmp, signum, code
):
    script = os.path.join(ray_tmp, "interrupted_start.py")
    with open(script, "w") as f:
        f.write(INTERRUPTED_START)
    # its own preload server (not the suite's), whose folder must not outlive it
    proc = _run([script, str(int(signum)), "guarded"], ray_tmp, unset=(forked_workers.SOCKET_ENV,))
    assert proc.returncode == code, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: stopped by {signal.Signals(signum).name} outside the training steps (start-up, resume or "
        f"shut-down): exiting with code {code}; the run's complete checkpoints are kept (resume with "
        "trainer.resume_mode=auto)"
    ]
    assert "finished" not in proc.stdout
    deadline = time.monotonic() + 10
    while _ray_processes_under(ray_tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _ray_processes_under(ray_tmp) == []
    deadline = time.monotonic() + 120  # the preload server leaves when its imports end, removing its folder
    while any(name.startswith("vb_workers_") for name in os.listdir(ray_tmp)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [name for name in os.listdir(ray_tmp) if name.startswith("vb_workers_")] == []
    plain = _run([script, str(int(signum)), "plain"], ray_tmp)  # negative control: Python's own handling
    if signum == signal.SIGTERM:
        assert plain.returncode == -signal.SIGTERM
    else:
        assert plain.returncode != code and "Traceback" in plain.stderr and "KeyboardInterrupt" in plain.stderr


class _UnstartedEarlyStart:
    """Stands in for the background start: records the arguments, starts nothing."""

    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.started = threading.Event()
        self.thread = threading.Thread(target=self.started.set)

    def at_exit(self):
        self.started.wait()


def test_no_early_start_for_hydras_flags_or_a_cluster_named_by_ray_address(monkeypatch):
    monkeypatch.setattr(ray_start, "_early", None)
    monkeypatch.setattr(ray_start, "_EarlyStart", _UnstartedEarlyStart)
    monkeypatch.setattr(ray_start.ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not START_EMBEDDED_EARLY(["--help"])
    assert not START_EMBEDDED_EARLY(["data.train_batch_size=8", "--cfg", "job"])
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert not START_EMBEDDED_EARLY(["data.train_batch_size=8"])
    assert ray_start.take_early_start({"address": "local"}) is False  # nothing to take
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a new embedded cluster: what no address gives
    assert START_EMBEDDED_EARLY(["data.train_batch_size=8"])  # positive control
    assert ray_start._early.kwargs == ray_start.embedded_defaults()
