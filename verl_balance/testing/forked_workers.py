"""The test suite's use of the preloaded-worker server (``single_controller/forked_workers.py``): one server
per session forks every Ray worker of every cluster the suite starts (through Ray's ``RAY_RUNTIME_ENV_HOOK``)
and the subprocess drivers of tests (``python_command``)."""

from __future__ import annotations

import os
import sys

from verl_balance.single_controller.forked_workers import SOCKET_ENV, WORKER_PRELOAD, client_argv, client_command

__all__ = ["SUITE_PRELOAD", "python_command", "runtime_env_hook"]

# The workers' modules and those of verl and LoRA (sympy, peft).
SUITE_PRELOAD = (*WORKER_PRELOAD, "sympy", "peft")


def runtime_env_hook(runtime_env: dict | None) -> dict | None:
    """Ray's ``RAY_RUNTIME_ENV_HOOK``: a job's workers start as forks of the server named by ``SOCKET_ENV``."""
    socket_path = os.environ.get(SOCKET_ENV)
    if not socket_path or (runtime_env or {}).get("py_executable"):
        return runtime_env
    return {**(runtime_env or {}), "py_executable": client_command(socket_path)}


def python_command(args: list[str]) -> list[str]:
    """``[python, *args]`` for a test's subprocess driver (``args``: ``-m MODULE ...`` or ``SCRIPT ...``):
    while a server runs, a client that has the driver forked from it."""
    socket_path = os.environ.get(SOCKET_ENV)
    if not socket_path:
        return [sys.executable, *args]
    return [*client_argv(socket_path, driver=True), *args]
