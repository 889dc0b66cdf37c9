"""``start_ray``'s ``ray.init`` arguments (``ray_init_arguments``): without an address, a new local
cluster even when a dead one left its address file behind (Ray's ``ray_current_cluster``); with
``RAY_ADDRESS`` set by the user, that cluster, joined without sizing it.

The address Ray would use is resolved by Ray's own ``get_ray_address_from_environment`` from what
``start_ray`` passes to ``ray.init``, in this process, with the stale file planted under a private
``RAY_TMPDIR`` (never the machine-wide /tmp/ray)."""

from __future__ import annotations

import pytest
from ray._common.utils import get_ray_address_file
from ray._private.services import get_ray_address_from_environment

from verl_balance.trainer import cluster, ray_start

# Marked slow by the rule of tests/test_slow_marks.py (it reads Ray's own address resolution), though
# it starts no process.
pytestmark = pytest.mark.slow

STALE = "127.0.0.1:9"  # the discard port: nothing answers there


@pytest.fixture
def stale_address_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    path = get_ray_address_file(None)
    assert path.startswith(str(tmp_path))
    (tmp_path / "ray").mkdir()
    with open(path, "w") as f:
        f.write(STALE)
    return path


def test_a_stale_cluster_address_file_is_not_joined_by_the_embedded_start(stale_address_file):
    # Negative control: Ray itself, given no address, picks the planted dead cluster.
    assert get_ray_address_from_environment(None, None) == STALE
    embedded, kwargs = cluster.ray_init_arguments(address=None, ray_init=None)
    assert embedded and kwargs["address"] == "local"
    assert get_ray_address_from_environment(kwargs["address"], None) == "local"
    assert kwargs["num_cpus"] == ray_start.embedded_cluster_cpus()


def test_ray_address_in_the_environment_is_joined_without_sizing_it(stale_address_file, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    embedded, kwargs = cluster.ray_init_arguments(address=None, ray_init=None)
    # Joining a running cluster: ray.init refuses num_cpus there, so none is passed.
    assert not embedded and "num_cpus" not in kwargs
    assert get_ray_address_from_environment(kwargs["address"], None) == "10.0.0.5:6379"


def test_ray_address_local_asks_for_the_embedded_cluster(stale_address_file, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "local")
    embedded, kwargs = cluster.ray_init_arguments(address=None, ray_init=None)
    assert embedded and kwargs["address"] == "local" and not kwargs["include_dashboard"]
