"""The embedded cluster's workers are forks of a preloaded interpreter (``trainer/ray_start.py``
``with_preloaded_workers``, ``single_controller/forked_workers.py``): a Ray worker of a fresh driver already has
torch when its task starts, with ``VERL_BALANCE_PRELOADED_WORKERS=0`` it has not (the negative control), and
the server goes when its driver does. Each driver runs in its own interpreter and ``RAY_TMPDIR``, without the
suite's own server (``tests/conftest.py`` names one in the environment)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from verl_balance.single_controller import forked_workers
from verl_balance.trainer import ray_start

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRIVER = """
import json, os, sys, ray
from verl_balance.trainer import ray_start

ray_start.start_embedded(ray_start.embedded_defaults())

@ray.remote(num_cpus=1)
def probe():
    import sys
    preloaded = sorted(m for m in ("torch", "tensordict", "verl_balance") if m in sys.modules)
    import torch
    return {"preloaded": preloaded, "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}

out = ray.get(probe.remote(), timeout=300)
out["socket"] = os.environ.get("VERL_BALANCE_FORKED_WORKERS_SOCKET")
print("PROBE " + json.dumps(out), flush=True)
"""

pytestmark = pytest.mark.slow


def _run_driver(tmp: str, **env_vars: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (forked_workers.SOCKET_ENV, "RAY_RUNTIME_ENV_HOOK")}
    env.update(PYTHONPATH=os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")]), RAY_TMPDIR=tmp, **env_vars)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=300, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line.removeprefix("PROBE "))


@pytest.fixture
def ray_tmp():
    tmp = tempfile.mkdtemp(prefix="rpw", dir="/tmp")  # Ray's socket paths must stay short
    yield tmp
    shutil.rmtree(tmp, ignore_errors=True)


def _gone(path: str, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.2)
    return not os.path.exists(path)


def test_the_embedded_clusters_workers_start_with_torch_imported_and_the_server_leaves_with_the_driver(ray_tmp):
    forked = _run_driver(ray_tmp)
    assert forked["preloaded"] == ["tensordict", "torch"]  # third-party modules only: not verl_balance
    assert (forked["omp"], forked["threads"]) == ("1", 1)  # Ray's OMP_NUM_THREADS of a 1-CPU task, as fresh
    folder = os.path.dirname(forked["socket"])
    assert _gone(folder), f"the server's folder {folder} outlived its driver"


def test_without_preloaded_workers_a_worker_imports_torch_itself(ray_tmp):
    fresh = _run_driver(ray_tmp, VERL_BALANCE_PRELOADED_WORKERS="0")  # negative control of the test above
    assert fresh["preloaded"] == [] and fresh["socket"] is None
    assert (fresh["omp"], fresh["threads"]) == ("1", 1)


def test_transformers_is_preloaded_only_when_a_command_line_names_a_model_directory():
    with_transformers = forked_workers.WORKER_PRELOAD
    assert "transformers" in with_transformers
    assert ray_start.worker_preload(["model.path=/m"]) == with_transformers
    assert (
        ray_start.worker_preload(["actor_rollout_ref.model.path=/m", "trainer.n_gpus_per_node=8"]) == with_transformers
    )
    assert ray_start.worker_preload(["+model.partial_pretrain=/m"]) == with_transformers
    for argv in ([], ["trainer.device=cpu"], ["model.path=null"], ["data.path=/d"]):
        preload = ray_start.worker_preload(argv)
        assert "torch" in preload and not any("transformers" in m for m in preload), argv


def test_a_runtime_env_with_its_own_interpreter_or_the_switch_off_keeps_rays_workers(monkeypatch):
    def no_server(*args, **kwargs):
        raise AssertionError("no server may start")

    monkeypatch.setattr(forked_workers, "start_server", no_server)
    monkeypatch.delenv(forked_workers.SOCKET_ENV, raising=False)
    for runtime_env in ({"pip": ["x"]}, {"conda": "env"}, {"py_executable": "uv run"}, {"image_uri": "img"}):
        kwargs = {"address": "local", "runtime_env": runtime_env}
        assert ray_start.with_preloaded_workers(kwargs) == kwargs
    monkeypatch.setenv(ray_start.PRELOADED_WORKERS_ENV, "0")
    assert ray_start.with_preloaded_workers({"runtime_env": {"env_vars": {"A": "1"}}}) == {
        "runtime_env": {"env_vars": {"A": "1"}}
    }
    monkeypatch.delenv(ray_start.PRELOADED_WORKERS_ENV)

    def no_pidfd(pid):
        raise OSError(38, "Function not implemented")  # a kernel before 5.3

    with monkeypatch.context() as old_kernel:
        old_kernel.setattr(os, "pidfd_open", no_pidfd)
        assert ray_start.with_preloaded_workers({"runtime_env": {}}) == {"runtime_env": {}}
    monkeypatch.setattr(ray_start, "accelerator_device_nodes", lambda: ["/dev/nvidia0"])
    assert ray_start.with_preloaded_workers({"runtime_env": {}}) == {"runtime_env": {}}  # a GPU machine: Ray's way
    monkeypatch.setenv(ray_start.PRELOADED_WORKERS_ENV, "1")  # asked for there too
    monkeypatch.setenv(forked_workers.SOCKET_ENV, "/tmp/named/socket")  # a named server is used, none started
    with_server = ray_start.with_preloaded_workers({"runtime_env": {"env_vars": {"A": "1"}}})
    assert with_server["runtime_env"] == {
        "env_vars": {"A": "1"},
        "py_executable": forked_workers.client_command("/tmp/named/socket"),
    }
