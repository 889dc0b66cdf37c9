"""Warm worker hosts: a clean group's processes serve the next group as fresh processes would.

The reference for "fresh" is a group of the same class with hosting off (one new actor per worker).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from ray import cloudpickle
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from verl_balance.single_controller import (
    Dispatch,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    register,
)
from verl_balance.testing import worker_hosts
from verl_balance.testing.worker_host import WorkerHost
from verl_balance.testing.worker_hosts import worker_hosting

pytestmark = pytest.mark.slow  # Ray worker processes

cloudpickle.register_pickle_by_value(sys.modules[__name__])

WORLD = 2


class HostProbeWorker(Worker):
    """Reports the process state a hosted worker must see fresh, and pollutes it on request."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def probe(self) -> dict:
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="env://", rank=self.rank, world_size=self.world_size)
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total)
        mesh = init_device_mesh("cpu", (self.world_size,))
        doubled = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]) * 2
        return {
            "pid": os.getpid(),
            "rank": self.rank,
            "all_reduce_sum": total.item(),
            "mesh_coordinate": doubled.device_mesh.get_coordinate(),
            "leaked_env": os.environ.get("HOST_PROBE_LEAK"),
            "initial_seed": torch.initial_seed(),
            "first_random": torch.rand(1).item(),
            "default_dtype": str(torch.get_default_dtype()),
            "grad_enabled": torch.is_grad_enabled(),
            "release_timeout_s": worker_hosts.RELEASE_TIMEOUT_S,
        }

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pollute(self) -> None:
        os.environ["HOST_PROBE_LEAK"] = "1"
        torch.manual_seed(123)
        torch.set_default_dtype(torch.float64)
        torch.set_grad_enabled(False)
        worker_hosts.RELEASE_TIMEOUT_S = -1.0  # a module global rebound, as a test's stub would be

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> None:
        if self.rank == rank:
            raise ValueError(f"failing on rank {rank}")


class UnlistedWorker(HostProbeWorker):
    """A subclass of a hosted class: hosting is by exact class, so this one is never hosted."""


def run_group(cls: type, *, pollute: bool = False, fail: bool = False, env: dict | None = None) -> list[dict]:
    """One group of ``cls``: probe (then pollute or fail) and shut it down; the probe per rank."""
    pool = RayResourcePool([WORLD], use_gpu=False)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls), worker_env=env)
    try:
        infos = group.probe()
        if pollute:
            group.pollute()
        if fail:
            with pytest.raises(ValueError, match="failing on rank 1"):
                group.fail_on(1)
    finally:
        group.shutdown()
        pool.remove()
    return infos


# A Ray worker process draws its own initial seed: a hosted worker sees its host's, a fresh one a new one.
PROCESS_FIELDS = ("pid", "initial_seed", "first_random")


def without_pid(infos: list[dict]) -> list[dict]:
    return [{k: v for k, v in info.items() if k not in PROCESS_FIELDS} for info in infos]


def by_pid(infos: list[dict]) -> dict[int, tuple]:
    return {info["pid"]: (info["initial_seed"], info["first_random"]) for info in infos}


def test_a_clean_groups_processes_serve_the_next_group_as_fresh_processes(ray_cluster):
    fresh = run_group(HostProbeWorker)  # hosting off in this block: the reference
    with worker_hosting(classes=(HostProbeWorker,), host=WorkerHost) as hosts:
        first = run_group(HostProbeWorker, pollute=True)
        second = run_group(HostProbeWorker)
        assert sorted(i["pid"] for i in second) == sorted(i["pid"] for i in first)  # the processes were reused
        assert without_pid(second) == without_pid(fresh) == without_pid(first)
        assert by_pid(second) == by_pid(first)  # torch's RNG as the host process started: reseeded
        assert fresh[0]["all_reduce_sum"] == 3.0 and fresh[0]["leaked_env"] is None
        assert fresh[0]["default_dtype"] == "torch.float32" and fresh[0]["release_timeout_s"] > 0
        assert [i["mesh_coordinate"] for i in fresh] == [(rank,) for rank in range(WORLD)]
        assert sum(len(idle) for idle in hosts._idle.values()) == WORLD
        # a host that rejoins as another rank sees its own mesh coordinate (no DTensor cache of the old mesh)
        for idle in hosts._idle.values():
            idle.reverse()  # the next group's rank 0 gets the host that was rank 1
        swapped = run_group(HostProbeWorker)
        assert {i["pid"]: i["rank"] for i in swapped} == {i["pid"]: WORLD - 1 - i["rank"] for i in second}
        assert without_pid(swapped) == without_pid(fresh)
        # negative control of the reset: the pollution is visible inside the polluting group itself
        pool = RayResourcePool([WORLD], use_gpu=False)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(HostProbeWorker))
        try:
            group.pollute()
            polluted = group.probe()
        finally:
            group.shutdown()
            pool.remove()
    assert without_pid(polluted) != without_pid(fresh)
    assert {seed for seed, _ in by_pid(polluted).values()} == {123}
    assert polluted[0]["leaked_env"] == "1" and polluted[0]["default_dtype"] == "torch.float64"


def test_a_failed_group_or_another_environment_or_class_gets_new_processes(ray_cluster):
    with worker_hosting(classes=(HostProbeWorker,), host=WorkerHost) as hosts:
        failed = run_group(HostProbeWorker, fail=True)
        after_failure = run_group(HostProbeWorker)
        assert not {i["pid"] for i in failed} & {i["pid"] for i in after_failure}
        other_env = run_group(HostProbeWorker, env={"HOST_PROBE_VARIANT": "b"})
        assert not {i["pid"] for i in after_failure} & {i["pid"] for i in other_env}
        run_group(UnlistedWorker)  # a clean run: were its class hosted, its 2 hosts would be idle now
        assert sum(len(idle) for idle in hosts._idle.values()) == 2 * WORLD  # after_failure's and other_env's only


def test_a_killed_host_is_not_reused(ray_cluster):
    import ray

    with worker_hosting(classes=(HostProbeWorker,), host=WorkerHost):
        pool = RayResourcePool([WORLD], use_gpu=False)
        group = RayWorkerGroup(pool, RayClassWithInitArgs(HostProbeWorker))
        try:
            before = group.probe()
            ray.kill(group.workers[1], no_restart=True)
            with pytest.raises(Exception, match="died"):
                group.probe()
        finally:
            group.shutdown()
            pool.remove()
        after = run_group(HostProbeWorker)
        assert not {i["pid"] for i in before} & {i["pid"] for i in after}
