"""Session-wide fixtures: one embedded Ray cluster for every Ray test (start-up is the slow part)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.file_order import load_weights, slowest_files_first

# One intra-op thread in the test process and in every process it starts (they inherit the variable):
# the suite's processes (two xdist workers, their gloo ranks and Ray workers) outnumber the cores, and
# with torch's default of one thread per core every small op waits for a second, busy core to join it
# (a tiny model's generate call took 18 s with 2 threads and 0.3 s with 1 at load 15 here).
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# Every Ray cluster of the session (they inherit the variable) reports its node's process statistics
# to the dashboard once a minute instead of every 5 s: a psutil pass over every worker process of the
# node each time, and the suite reads none of it.
os.environ.setdefault("REPORTER_UPDATE_INTERVAL_MS", "60000")
# The rest of an idle cluster's CPU that the suite reads nothing of (3.7 -> 1.9 s of CPU a minute per
# idle cluster here, and the suite runs up to four at once): no idle workers started ahead of the first
# driver's tasks (each test starts exactly the workers it needs), no metrics export from every worker
# process, no usage-stats reporter, and the log monitor lists the log folder every 0.5 s instead of
# every 0.1 s (Ray's own pace for folders of 1,000+ files; a new file is read from its start, so a
# late-found file loses no line).
for name, value in (
    ("RAY_prestart_worker_first_driver", "0"),
    ("RAY_enable_metrics_collection", "0"),
    ("RAY_USAGE_STATS_ENABLED", "0"),
    ("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0"),
):
    os.environ.setdefault(name, value)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 workers of the largest test layout + headroom for a second group being torn down.
RAY_NUM_CPUS = 6
# A slow test (the only ones with Ray workers) in which a Ray worker process died of a native crash
# (Ray's fault handler prints "*** SIGSEGV received" to the worker's stderr, which WorkerDiedError
# quotes) runs once more. One such crash (a segfault in malloc on a non-Python thread of a CPU rollout
# worker, in 1 of ~15 suite runs) failed a CI run; no test of ours asserts a native crash through this
# path. Any other failure fails at once, and pytest's summary lists every rerun test.
NATIVE_CRASH_OF_A_WORKER = r"WorkerDiedError: (?s:.*)\*\*\* SIG(SEGV|BUS|ABRT|ILL|FPE) received"
# CI's lanes (.ci/run): the README's command runs in a venv without verl, and every test it skips for
# want of verl appends its node id (a test, or a whole module skipped at import) to the file this
# variable names; the verl lane then runs exactly those, in a venv with verl.
VERL_SKIPS_ENV = "VERL_BALANCE_VERL_SKIPS"


def pytest_configure(config):
    # xdist hands out files in collection order once its own reorder (most tests first) is off;
    # pytest_collection_modifyitems below puts the slowest files first (tests/file_order.py).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if _reruns_native_crashes(config):
        config.option.reportchars = (config.option.reportchars or "") + "R"  # rerun tests in the summary


def _reruns_native_crashes(config) -> bool:
    """pytest-rerunfailures is installed and the command line sets no rerun policy of its own."""
    return config.pluginmanager.hasplugin("rerunfailures") and config.getoption("reruns") is None


def pytest_collection_modifyitems(config, items):
    order = slowest_files_first([item.nodeid for item in items], load_weights())
    items[:] = [items[i] for i in order]
    if _reruns_native_crashes(config):
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(pytest.mark.flaky(reruns=1, only_rerun=[NATIVE_CRASH_OF_A_WORKER]))


def _record_verl_skip(report) -> None:
    path = os.environ.get(VERL_SKIPS_ENV)
    if not path or not report.skipped or not isinstance(report.longrepr, tuple):
        return
    reason = str(report.longrepr[2])
    if "'verl" in reason or "verl-balance[verl]" in reason or "No module named 'verl" in reason:
        with open(path, "a") as f:
            f.write(report.nodeid + "\n")


def pytest_runtest_logreport(report):
    _record_verl_skip(report)


def pytest_collectreport(report):
    _record_verl_skip(report)


@pytest.fixture(autouse=True)
def no_early_ray_start(monkeypatch):
    """An entry point run inside this process (runpy) starts no embedded cluster of its own at launch: the
    session's cluster (``ray_cluster``) or the test decides what runs here. Subprocess drivers keep the early
    start; tests/trainer/test_ray_early_start.py tests it."""
    from verl_balance.trainer import ray_start

    monkeypatch.setattr(ray_start, "start_embedded_early", lambda argv: False)


@pytest.fixture(scope="session", autouse=True)
def forked_ray_workers(request):
    """Every Ray worker the session starts (here, in verl's clusters and in subprocess drivers) is a fork
    of one preloaded interpreter (``verl_balance/single_controller/forked_workers.py``): about 4 s of CPU less per
    worker process. Only sessions with slow tests start one (the fast lane has no Ray);
    ``VERL_BALANCE_FORKED_WORKERS=0`` starts workers as Ray does by default."""
    has_slow = any(item.get_closest_marker("slow") for item in request.session.items)
    if not has_slow or os.environ.get("VERL_BALANCE_FORKED_WORKERS", "1") == "0":
        yield None
        return
    import shutil
    import tempfile

    from verl_balance.single_controller.forked_workers import SOCKET_ENV, start_server
    from verl_balance.testing import forked_workers

    folder = tempfile.mkdtemp(prefix="vbfw", dir="/tmp")  # short: a socket path has at most 107 bytes
    socket_path = os.path.join(folder, "socket")
    server = start_server(socket_path, env=dict(os.environ), preload=forked_workers.SUITE_PRELOAD)
    os.environ[SOCKET_ENV] = socket_path
    os.environ["RAY_RUNTIME_ENV_HOOK"] = f"{forked_workers.__name__}.runtime_env_hook"
    yield socket_path
    os.environ.pop(SOCKET_ENV, None)
    os.environ.pop("RAY_RUNTIME_ENV_HOOK", None)
    server.terminate()
    server.wait(timeout=30)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_cluster(forked_ray_workers):
    """Start Ray once (or reuse a running session) and stop it at the end if we started it."""
    ray = pytest.importorskip("ray")
    started_here = not ray.is_initialized()
    if started_here:
        python_path = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
        from verl_balance.trainer.ray_start import init_embedded

        # Retried like the recipes' embedded start: Ray's fixed node start-up timeout can trip on a
        # loaded machine, and one failure here would error every Ray test of the session.
        init_embedded(
            address="local",  # always a fresh embedded cluster, never another process's running one
            num_cpus=RAY_NUM_CPUS,
            include_dashboard=False,
            log_to_driver=False,
            # workers import verl_balance from this checkout even when it is not pip-installed;
            # one intra-op thread per worker process: the workers share a few cores
            runtime_env={"env_vars": {"PYTHONPATH": python_path, "OMP_NUM_THREADS": "1"}},
        )
    # Successive trainer runs reuse idle worker processes instead of paying an interpreter, torch
    # and FSDP per worker again (testing/worker_hosts.py); test-defined classes are not hosted.
    from verl_balance.testing.worker_host import WorkerHost
    from verl_balance.testing.worker_hosts import disable_worker_hosts, enable_worker_hosts

    enable_worker_hosts(classes=hosted_worker_classes(), host=WorkerHost)
    yield ray
    disable_worker_hosts()
    if started_here:
        ray.shutdown()


def hosted_worker_classes() -> tuple[type, ...]:
    """The trainer's worker classes: their groups run in warm processes during the suite."""
    from verl_balance.workers.actor import ActorWorker
    from verl_balance.workers.actor_rollout import ActorRolloutWorker
    from verl_balance.workers.critic import CriticWorker
    from verl_balance.workers.rollout_worker import RolloutWorker
    from verl_balance.workers.weight_sync import AsyncActorRolloutWorker

    return (ActorWorker, ActorRolloutWorker, AsyncActorRolloutWorker, CriticWorker, RolloutWorker)
