"""``single_controller/setup_worker.py`` starts a worker as Ray's ``setup_worker.py`` does (the reference: Ray's
own script, run on the same raylet arguments), without importing Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from verl_balance.single_controller import setup_worker

ENV_KEYS = ("VB_A", "VB_B", "VB_C", "VB_D", "VB_PREFIX")
PRINT_WORKER = (
    "import json, os, sys\n"
    f"print(json.dumps({{'argv': sys.argv[1:], 'env': {{k: os.environ.get(k) for k in {ENV_KEYS!r}}}}}))\n"
)


def _raylet_argv(worker: str, context: dict, language: str = "PYTHON") -> list[str]:
    """What the raylet passes a set-up script: the worker's arguments, then the context and the language."""
    return [
        worker,
        "--node-ip-address=127.0.0.1",
        "it's one argument",
        f"{setup_worker.CONTEXT_OPTION}{json.dumps(context)}",
        f"{setup_worker.LANGUAGE_OPTION}{language}",
    ]


def _start(script: str, argv: list[str], cwd) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("VB_")}
    command = [sys.executable, script, *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


CONTEXTS = {
    "empty": {},
    "env_vars": {"env_vars": {"VB_A": "x", "VB_B": "${HOME}/y", "VB_C": "${VB_NEVER_SET}z", "VB_D": "$VB_A-d"}},
    "command_prefix": {"command_prefix": ["export", "VB_PREFIX=from-prefix", "&&"], "env_vars": {"VB_A": "1"}},
    "py_executable_with_a_flag": {"py_executable": f"{sys.executable} -u"},
    "override_entrypoint": {"override_worker_entrypoint": "OVERRIDE"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONTEXTS))
def test_a_worker_gets_the_environment_and_command_line_that_rays_setup_worker_gives(tmp_path, name):
    worker = tmp_path / "worker.py"
    worker.write_text(PRINT_WORKER)
    (tmp_path / "OVERRIDE").write_text(PRINT_WORKER.replace("sys.argv[1:]", "['overridden', *sys.argv[1:]]"))
    context = CONTEXTS[name]
    argv = _raylet_argv(str(worker), context)
    ours, rays = (_start(script, argv, tmp_path) for script in (setup_worker.__file__, setup_worker.ray_setup_worker()))
    assert rays.returncode == 0 and rays.stdout, rays.stderr[-2000:]
    assert (ours.returncode, ours.stdout) == (rays.returncode, rays.stdout), (ours.stderr[-2000:], rays.stderr[-2000:])
    if name == "override_entrypoint":
        assert json.loads(ours.stdout)["argv"][0] == "overridden"
    if name == "env_vars":  # not vacuous: hand-worked expansion, a variable set before is seen, an unset one is ""
        env = json.loads(ours.stdout)["env"]
        assert env == {"VB_A": "x", "VB_B": os.environ["HOME"] + "/y", "VB_C": "z", "VB_D": "x-d", "VB_PREFIX": None}
        assert json.loads(ours.stdout)["argv"] == ["--node-ip-address=127.0.0.1", "it's one argument"]


@pytest.mark.slow
def test_a_context_field_it_does_not_know_goes_to_rays_own_script(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(PRINT_WORKER)
    ours = _start(setup_worker.__file__, _raylet_argv(str(worker), {"a_future_field": 1}), tmp_path)
    assert ours.returncode != 0 and "a_future_field" in ours.stderr  # Ray's RuntimeEnvContext refused it


def test_only_a_python_worker_with_a_known_context_is_started_without_ray():
    line = setup_worker.worker_command(_raylet_argv("w.py", {"env_vars": {"K": "v"}, "py_executable": "py"}))
    assert line == ({"K": "v"}, "exec py w.py --node-ip-address=127.0.0.1 'it'\"'\"'s one argument'")
    assert setup_worker.worker_command(_raylet_argv("w.py", {}, language="JAVA")) is None
    assert setup_worker.worker_command(_raylet_argv("w.py", {"a_future_field": 1})) is None
    assert setup_worker.worker_command(["w.py", f"{setup_worker.LANGUAGE_OPTION}PYTHON"]) is None  # no context
