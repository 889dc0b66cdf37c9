"""``start_ray`` without an address starts a new local cluster even when a dead one left its address
file behind (Ray's ``ray_current_cluster``), and still joins ``RAY_ADDRESS`` when the user sets it.

The address Ray would use is resolved by Ray's own ``get_ray_address_from_environment`` from what
``start_ray`` passes to ``ray.init``, in this process, with the stale file planted under a private
``RAY_TMPDIR`` (never the machine-wide /tmp/ray)."""

from __future__ import annotations

import pytest
from ray._common.utils import get_ray_address_file
from ray._private.services import get_ray_address_from_environment

from verl_balance.trainer import cluster

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


@pytest.fixture
def init_kwargs(monkeypatch):
    captured: dict = {}
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster, "_init_embedded", lambda **kwargs: captured.update(kwargs))
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 2.0})
    return captured


def test_a_stale_cluster_address_file_is_not_joined_by_the_embedded_start(stale_address_file, init_kwargs):
    # Negative control: Ray itself, given no address, picks the planted dead cluster.
    assert get_ray_address_from_environment(None, None) == STALE
    cluster.start_ray(address=None)
    assert init_kwargs["address"] == "local"
    assert get_ray_address_from_environment(init_kwargs["address"], None) == "local"
    assert init_kwargs["num_cpus"] == cluster.embedded_cluster_cpus()


def test_ray_address_in_the_environment_is_still_joined(stale_address_file, init_kwargs, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    cluster.start_ray(address=None)
    assert get_ray_address_from_environment(init_kwargs["address"], None) == "10.0.0.5:6379"
