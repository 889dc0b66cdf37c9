"""verl's ``ray_kwargs.ray_init`` reaches ``ray.init``: merged over start_ray's own arguments
(runtime_env key by key, nulls left out as in verl's main_ppo), ``num_cpus`` sizing the embedded
cluster, ``address`` as trainer.ray_address's other spelling; a key ray.init does not take is refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from verl_balance.single_controller import setup_worker
from verl_balance.trainer import cluster, ray_start
from verl_balance.trainer.config.checks import ConfigError
from verl_balance.trainer.config.ray_init import check_ray_init, merge_ray_init

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_merge_puts_the_users_arguments_over_ours_and_runtime_env_key_by_key():
    ours = {"num_cpus": 8, "runtime_env": {"env_vars": {"A": "1", "B": "2"}}, "_system_config": {"x": 1}}
    user = {
        "num_cpus": 3,
        "namespace": None,
        "runtime_env": {"env_vars": {"B": 5, "C": "3"}, "py_executable": None, "working_dir": "/w"},
        "_system_config": {"y": 2},
    }
    assert merge_ray_init(ours, user) == {  # worked by hand
        "num_cpus": 3,
        "runtime_env": {"env_vars": {"A": "1", "B": "5", "C": "3"}, "working_dir": "/w"},
        "_system_config": {"x": 1, "y": 2},
    }
    assert merge_ray_init(ours, None) == ours


def test_a_key_ray_init_does_not_take_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"ray_kwargs\.ray_init: ray\.init takes no argument bogus, nope"):
        check_ray_init({"num_cpus": 2, "nope": 1, "bogus": None or 1})
    assert check_ray_init({"_temp_dir": "/t", "num_cpus": None}) == {"_temp_dir": "/t"}  # Ray checks its own _*


def test_ray_init_reaches_the_embedded_clusters_arguments():
    embedded, kwargs = cluster.ray_init_arguments(
        address=None, ray_init={"num_cpus": 3, "runtime_env": {"env_vars": {"X": 1}}}
    )
    assert embedded and kwargs["num_cpus"] == 3  # not embedded_cluster_cpus()
    quiet = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    env_vars = {**quiet, **ray_start.worker_warning_env()}
    env_vars["X"] = "1"
    assert kwargs["runtime_env"]["env_vars"] == env_vars
    assert kwargs["_system_config"]["worker_niceness"] == ray_start.EMBEDDED_WORKER_NICENESS
    _, plain = cluster.ray_init_arguments(address=None, ray_init=None)  # negative control: the machine's size
    assert plain["num_cpus"] == ray_start.embedded_cluster_cpus()


def test_embedded_cluster_starts_no_idle_workers_and_no_metrics_export_unless_the_user_says():
    _, kwargs = cluster.ray_init_arguments(address=None, ray_init=None)
    assert kwargs["_system_config"]["prestart_worker_first_driver"] is False
    assert kwargs["_system_config"]["enable_metrics_collection"] is False
    _, user = cluster.ray_init_arguments(
        address=None, ray_init={"_system_config": {"prestart_worker_first_driver": True}}
    )  # the user's choice wins, key by key
    assert user["_system_config"]["prestart_worker_first_driver"] is True
    assert user["_system_config"]["enable_metrics_collection"] is False
    _, joined = cluster.ray_init_arguments(address="ray://h:1", ray_init=None)  # an existing cluster: its own
    assert "_system_config" not in joined


def test_workers_hide_future_warnings_unless_the_user_chose_warnings(monkeypatch):
    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    _, kwargs = cluster.ray_init_arguments(address=None, ray_init=None)
    assert kwargs["runtime_env"]["env_vars"]["PYTHONWARNINGS"] == "ignore::FutureWarning"
    monkeypatch.setenv("PYTHONWARNINGS", "default")  # negative control: the user's setting reaches the workers
    _, kwargs = cluster.ray_init_arguments(address=None, ray_init=None)
    assert "PYTHONWARNINGS" not in kwargs["runtime_env"]["env_vars"]


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_worker_prefixes_are_plain_on_a_pipe_and_coloured_on_a_terminal(monkeypatch):
    monkeypatch.setenv("RAY_COLOR_PREFIX", "")  # recorded, so the value set below is undone after the test
    monkeypatch.delenv("RAY_COLOR_PREFIX")
    ray_start.plain_worker_prefixes(_Stream(tty=True))
    assert "RAY_COLOR_PREFIX" not in os.environ  # a terminal keeps Ray's colours
    ray_start.plain_worker_prefixes(_Stream(tty=False))
    assert os.environ["RAY_COLOR_PREFIX"] == "0"
    monkeypatch.setenv("RAY_COLOR_PREFIX", "1")
    ray_start.plain_worker_prefixes(_Stream(tty=False))
    assert os.environ["RAY_COLOR_PREFIX"] == "1"  # the user's choice stands


def test_ray_init_address_joins_that_cluster_and_two_addresses_are_refused():
    embedded, kwargs = cluster.ray_init_arguments(address=None, ray_init={"address": "10.0.0.1:6379", "namespace": "n"})
    assert not embedded and kwargs["address"] == "10.0.0.1:6379" and kwargs["namespace"] == "n"
    assert "num_cpus" not in kwargs
    with pytest.raises(ConfigError, match=r"trainer\.ray_address=.*ray_kwargs\.ray_init\.address="):
        cluster.ray_init_arguments(address="auto", ray_init={"address": "10.0.0.1:6379"})


@pytest.mark.slow
def test_a_real_embedded_cluster_has_the_cpus_asked_no_api_server_and_workers_set_up_by_our_script():
    # In its own interpreter: this process may already hold the session's Ray cluster.
    temp_dir = tempfile.mkdtemp(prefix="rk", dir="/tmp")  # Ray's socket paths must stay short
    script = (
        "import ray\n"
        "from verl_balance.trainer import cluster\n"
        f"cluster.start_ray(address=None, ray_init={{'num_cpus': 3, '_temp_dir': {temp_dir!r}}})\n"
        "print('CPU', ray.cluster_resources()['CPU'])\n"
        "print(*('process ' + name for name in ray._private.worker._global_node.all_processes), sep=chr(10))\n"
        "print('setup', ray._private.worker._global_node._ray_params.setup_worker_path)\n"
        "import os\n"
        "print('env', ray.get(ray.remote(lambda: os.environ.get('TOKENIZERS_PARALLELISM')).remote()))\n"
        "ray.shutdown()\n"
    )
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])}
        env.pop("RAY_ADDRESS", None)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "CPU 3.0" in proc.stdout.splitlines()
        processes = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("process ")}
        assert "raylet" in processes and "dashboard" not in processes  # include_dashboard=False: no API server
        # a worker set up by our script, with the job's runtime_env variables
        assert f"setup {setup_worker.__file__}" in proc.stdout.splitlines() and "env false" in proc.stdout.splitlines()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_embedded_node_takes_a_free_agent_port_and_no_monitor_only_inside_the_start():
    from ray._private.parameter import RayParams

    with ray_start.embedded_node_parameters():
        assert RayParams().dashboard_agent_listen_port == 0  # the agent binds any free port
        assert RayParams().no_monitor is True
        assert RayParams().setup_worker_path == setup_worker.__file__
        assert RayParams(dashboard_agent_listen_port=40001).dashboard_agent_listen_port == 40001  # explicit wins
        assert RayParams(no_monitor=False).no_monitor is False
    assert RayParams().dashboard_agent_listen_port == 52365  # negative control: Ray's fixed default outside
    assert RayParams().no_monitor is False
    assert RayParams().setup_worker_path is None


@pytest.mark.slow
def test_embedded_head_starts_an_api_server_only_when_the_dashboard_is_not_off(monkeypatch):
    from ray._private.node import Node

    calls = []
    monkeypatch.setattr(Node, "start_api_server", lambda self, **kwargs: calls.append(kwargs["include_dashboard"]))
    with ray_start.embedded_node_parameters():
        for include_dashboard in (False, None, True):
            Node.start_api_server(object(), include_dashboard=include_dashboard, raise_on_failure=False)
    assert calls == [None, True]  # include_dashboard=False: no API server
    Node.start_api_server(object(), include_dashboard=False, raise_on_failure=False)
    assert calls == [None, True, False]  # negative control: Ray's own start outside the context
