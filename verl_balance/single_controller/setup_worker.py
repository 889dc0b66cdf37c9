"""The embedded node's worker set-up: Ray's ``setup_worker.py`` without importing Ray.

The raylet starts every worker of a job with a ``runtime_env`` as ``python SETUP_WORKER [-S] [-s] WORKER_ARGS...
--serialized-runtime-env-context=JSON --language=NAME``; the set-up script applies the context's environment
variables and replaces itself with ``bash -c "PREFIX exec PY_EXECUTABLE WORKER_ARGS"``. Ray's own script imports
Ray for that (0.5-0.7 CPU s per worker, before the worker's interpreter starts); this one is stdlib only and
gives the worker the same environment and command line (``tests/single_controller/test_setup_worker.py`` runs
both on the same arguments). A context with a field it does not know, or a worker in another language, goes to
Ray's script unchanged. ``trainer/ray_start.py`` names this file as the embedded node's ``setup_worker_path``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from importlib.util import find_spec

CONTEXT_OPTION = "--serialized-runtime-env-context="
LANGUAGE_OPTION = "--language="
KNOWN_FIELDS = frozenset({"command_prefix", "env_vars", "py_executable", "override_worker_entrypoint", "java_jars"})
_UNSET_VARIABLE = re.compile(r"\$\{[A-Z0-9_]+\}")


def ray_setup_worker() -> str:
    """The path of Ray's own set-up script (found without importing Ray)."""
    spec = find_spec("ray")
    assert spec is not None and spec.origin is not None, "Ray is not installed"
    return os.path.join(os.path.dirname(spec.origin), "_private", "workers", "setup_worker.py")


def worker_command(argv: list[str]) -> tuple[dict[str, str], str] | None:
    """``(the context's env_vars, the bash command line)`` that start the worker ``argv`` asks for; None when
    Ray's script must do it (another language, an unknown context field, no or unreadable context)."""
    context_text, language, worker_args = None, None, []
    for arg in argv:
        if arg.startswith(CONTEXT_OPTION):
            context_text = arg[len(CONTEXT_OPTION) :]
        elif arg.startswith(LANGUAGE_OPTION):
            language = arg[len(LANGUAGE_OPTION) :]
        else:
            worker_args.append(arg)
    if context_text is None or language != "PYTHON" or not worker_args:
        return None
    try:
        context = json.loads(context_text or "{}")
    except ValueError:
        return None
    if not isinstance(context, dict) or not set(context) <= KNOWN_FIELDS:
        return None
    if context.get("override_worker_entrypoint"):
        worker_args[0] = context["override_worker_entrypoint"]
    executable = context.get("py_executable") or sys.executable
    words = [*(context.get("command_prefix") or []), "exec", executable, *map(shlex.quote, worker_args)]
    return dict(context.get("env_vars") or {}), " ".join(words)


def main(argv: list[str]) -> None:
    command = worker_command(argv)
    if command is None:
        os.execv(sys.executable, [sys.executable, ray_setup_worker(), *argv])
    env_vars, line = command
    for key, value in env_vars.items():  # in order, as Ray does: a value may name a variable set before it
        os.environ[key] = _UNSET_VARIABLE.sub("", os.path.expandvars(value))  # an unset ${X} becomes ""
    os.execvp("bash", ["bash", "-c", line])


if __name__ == "__main__":
    main(sys.argv[1:])
