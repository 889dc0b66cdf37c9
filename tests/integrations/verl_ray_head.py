"""One Ray cluster (``ray start --head``) that every verl subprocess of a test session connects to.

verl's ``main_ppo`` runs and the pieces runners each started their own Ray instance (about 15 s on
2 CPU cores); connecting to this one costs about a second. Per-run variables reach the cluster's
workers through ``ray.init(runtime_env={"env_vars": ...})``: its raylet has only ``cluster_env()``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
# What a runner forwards to its workers (``runtime_env``): the cluster's raylet does not have them.
WORKER_VARS = ("VERL_USE_EXTERNAL_MODULES", "VERL_BALANCE_WORKLOAD", "PYTHONPATH", "OMP_NUM_THREADS")


def cluster_env() -> dict[str, str]:
    """The environment shared by every run: the Ray cluster's (its workers inherit it) and each driver's."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([REPO_ROOT, HERE]),
        OMP_NUM_THREADS="1",
        VERL_PLATFORM="cpu",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="disabled",
        RAY_AUTH_MODE="disabled",  # ``ray start`` turns on token authentication by default
    )
    # Ray refuses a logical GPU count (below) when CUDA_VISIBLE_DEVICES is set and empty.
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("RAY_ADDRESS", None)
    return env


@contextlib.contextmanager
def ray_head(log_dir: str) -> Iterator[str]:
    """A ``ray start --head --block`` cluster for the duration of the block; yields its address.

    verl's ResourcePoolManager checks for one GPU per worker and reserves CPU bundles; on a CPU host
    these are Ray's logical counts only (the cpu platform asks Ray for no accelerator). No dashboard:
    its processes only cost CPU here. Its own temp dir (short: Ray's socket paths are length-limited):
    /tmp/ray's current-cluster file stays untouched, so no other Ray user on the host connects to it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(os.path.join(log_dir, "ray_start.log"), "w")
    temp_dir = tempfile.mkdtemp(prefix="vbray", dir="/tmp")
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", f"--port={port}"]
    cmd += [f"--temp-dir={temp_dir}"]
    cmd += ["--node-ip-address=127.0.0.1", "--num-cpus=16", "--num-gpus=2", "--include-dashboard=false"]
    head = subprocess.Popen(cmd, env=cluster_env(), stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    status = [sys.executable, "-m", "ray.scripts.scripts", "status", f"--address={address}"]
    deadline = time.monotonic() + 180
    try:
        while subprocess.run(status, env=cluster_env(), capture_output=True).returncode != 0:
            assert head.poll() is None and time.monotonic() < deadline, open(log.name).read()[-4000:]
            time.sleep(2)
        yield address
    finally:
        head.terminate()  # --block: ray start stops the cluster's processes on SIGTERM
        head.wait(timeout=60)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def runner_env(address: str, **run_vars: str) -> dict[str, str]:
    """A pieces runner's environment: the cluster's, its address, and its per-run variables."""
    return dict(cluster_env(), RAY_ADDRESS=address, **run_vars)


def connect_runner() -> None:
    """In a runner: connect to ``RAY_ADDRESS`` (a local instance of 4 CPUs when unset or ``local``) and
    give the workers this process's ``WORKER_VARS``."""
    import ray

    env_vars = {name: os.environ[name] for name in WORKER_VARS if name in os.environ}
    address = os.environ.get("RAY_ADDRESS") or "local"
    local = dict(num_cpus=4, include_dashboard=False) if address == "local" else {}
    ray.init(address=address, runtime_env={"env_vars": env_vars}, log_to_driver=True, **local)
