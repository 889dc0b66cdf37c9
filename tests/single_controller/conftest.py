"""One embedded Ray instance (4 CPUs) for every Ray test in the session."""

from __future__ import annotations

import os

import pytest

RAY_NUM_CPUS = 4


@pytest.fixture(scope="session")
def ray_cluster():
    """Start Ray once (or reuse a session someone else started) and stop it at the end if we started it."""
    ray = pytest.importorskip("ray")
    started_here = not ray.is_initialized()
    if started_here:
        repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        python_path = os.pathsep.join(p for p in (repo_root, os.environ.get("PYTHONPATH")) if p)
        ray.init(
            num_cpus=RAY_NUM_CPUS,
            include_dashboard=False,
            # workers import verl_balance from this checkout even when it is not pip-installed
            runtime_env={"env_vars": {"PYTHONPATH": python_path}},
        )
    yield ray
    if started_here:
        ray.shutdown()
