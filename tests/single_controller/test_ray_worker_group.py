"""A 4-worker CPU group on embedded Ray: rendezvous, every dispatch mode, errors, placement timeout."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from ray import cloudpickle

from tests.conftest import RAY_NUM_CPUS
from verl_balance.balance.plan import BalancePlan
from verl_balance.protocol import Batch
from verl_balance.single_controller import (
    Dispatch,
    Execute,
    MeshLayoutError,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    UnplaceableResourcePoolError,
    Worker,
    make_mesh_dispatch,
    register,
)
from verl_balance.single_controller.worker_group import GroupFuture
from verl_balance.trainer.plan_dispatch import merge_by_plan, split_by_plan

pytestmark = pytest.mark.slow  # Ray worker processes

# the worker class below is shipped to the Ray workers by value (this test module is not importable there)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SP_SIZE = 2


class ProbeWorker(Worker):
    """Joins a gloo group over the env the worker group sets and reports what it received."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag
        self.last_received: list[int] | None = None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_dist(self) -> dict:
        dist.init_process_group("gloo", init_method="env://", rank=self.rank, world_size=self.world_size)
        self.register_mesh("dp", dp_rank=self.rank, dp_size=self.world_size, is_collect=True)
        self.register_mesh(
            "dp_sp",
            dp_rank=self.rank // SP_SIZE,
            dp_size=self.world_size // SP_SIZE,
            is_collect=self.rank % SP_SIZE == 0,
        )
        total = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(total)
        return {**self.get_rank_info(), "all_reduce_sum": total.item(), "tag": self.tag}

    def _stamp(self, batch: Batch) -> Batch:
        self.last_received = batch["x"].tolist()
        out = batch.select(batch_keys=["x"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
        out["worker_rank"] = torch.full((len(batch),), self.rank)
        return out

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def stamp_dp(self, batch: Batch, offset: int) -> Batch:
        out = self._stamp(batch)
        out["x"] = out["x"] + offset
        return out

    @register(dispatch_mode=make_mesh_dispatch("dp_sp"))
    def stamp_dp_sp(self, batch: Batch) -> Batch:
        return self._stamp(batch)

    @register(dispatch_mode=make_mesh_dispatch("dp"))
    def stamp_dp_mesh(self, batch: Batch) -> Batch:
        return self._stamp(batch)

    @register(dispatch_mode=make_mesh_dispatch("never_registered"))
    def unroutable(self, batch: Batch) -> Batch:
        return batch

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def get_last_received(self) -> list[int] | None:
        return self.last_received

    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def times_rank(self, value: int) -> int:
        return value * self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def whoami(self) -> int:
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def slow_rank(self, delay_s: float) -> int:
        time.sleep(delay_s)
        return self.rank

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"bad sample on rank {rank}")
        return self.rank


def rows(n: int) -> Batch:
    return Batch.from_dict(
        tensors={"x": torch.arange(n)}, non_tensors={"uid": [f"u{i}" for i in range(n)]}, meta={"step": 7}
    )


@pytest.fixture(scope="module")
def group(ray_cluster):
    # one node of the session cluster: nnodes=2 would need two Ray nodes (see test_multinode.py)
    pool = RayResourcePool(n_gpus_per_node=4, use_gpu=False, placement_timeout_s=60)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(ProbeWorker, "probe"))
    init_results = wg.init_dist()
    yield wg, init_results
    wg.shutdown()
    pool.remove()


def test_workers_rendezvous_over_the_group_env(group):
    wg, infos = group
    assert wg.world_size == 4
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert [i["local_rank"] for i in infos] == [0, 1, 2, 3]
    assert len({i["node_id"] for i in infos}) == 1 and infos[0]["node_id"] == wg.resource_pool.node_ids()[0]
    assert {i["world_size"] for i in infos} == {4}
    assert len({(i["master_addr"], i["master_port"]) for i in infos}) == 1 and infos[0]["master_port"] > 0
    assert [i["all_reduce_sum"] for i in infos] == [10.0] * 4  # 1 + 2 + 3 + 4 over gloo
    assert {i["tag"] for i in infos} == {"probe"} and {i["num_threads"] for i in infos} == {1}
    assert len({i["pid"] for i in infos}) == 4


def test_dp_compute_proto_chunks_rows_over_ranks_and_concats_in_order(group):
    wg, _ = group
    out = wg.stamp_dp(rows(10), offset=100)
    assert out["x"].tolist() == [100 + i for i in range(10)]
    assert out["uid"].tolist() == [f"u{i}" for i in range(10)]
    assert out["worker_rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]


def test_mesh_dispatch_replicates_over_sp_and_collects_sp_rank_zero(group):
    wg, _ = group
    out = wg.stamp_dp_sp(rows(6))
    assert out["x"].tolist() == [0, 1, 2, 3, 4, 5]
    assert out["worker_rank"].tolist() == [0, 0, 0, 2, 2, 2]  # only SP rank 0 of each DP group returns
    assert wg.get_last_received() == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]


def test_mesh_dispatch_of_a_balance_plan_round_trips_to_input_order(group):
    wg, _ = group
    plan = BalancePlan(micro_batches=[[np.array([6, 1]), np.array([3])], [np.array([0, 5, 2]), np.array([4])]])
    chunks = split_by_plan(rows(7), plan)
    merged = merge_by_plan(wg.stamp_dp_sp(chunks), plan)
    assert merged["x"].tolist() == list(range(7)) and merged["uid"].tolist() == [f"u{i}" for i in range(7)]
    assert wg.get_last_received() == [[6, 1, 3], [6, 1, 3], [0, 5, 2, 4], [0, 5, 2, 4]]
    # pure DP mesh (dp=4, sp=1): every worker is its own DP group and collects
    out = wg.stamp_dp_mesh(rows(4))
    assert out["worker_rank"].tolist() == [0, 1, 2, 3]


def test_unregistered_mesh_names_the_ranks(group):
    wg, _ = group
    with pytest.raises(
        MeshLayoutError, match=r"worker rank\(s\) \[0, 1, 2, 3\] did not register mesh 'never_registered'"
    ):
        wg.unroutable(rows(4))


def test_all_to_all_one_to_all_and_rank_zero(group):
    wg, _ = group
    assert wg.times_rank([10, 10, 20, 20]) == [0, 10, 40, 60]
    assert wg.whoami() == 0
    assert wg.execute_all("whoami") == [0, 1, 2, 3]
    assert wg.execute_rank_zero("times_rank", 5) == 0


def test_non_blocking_method_returns_a_future(group):
    wg, _ = group
    future = wg.slow_rank(0.1)
    assert isinstance(future, GroupFuture)
    assert future.get() == [0, 1, 2, 3]


def test_worker_exception_keeps_its_type_and_names_the_rank(group):
    wg, _ = group
    with pytest.raises(ValueError, match="bad sample on rank 2") as info:
        wg.fail_on(2)
    assert any("worker rank 2" in note and "fail_on" in note for note in getattr(info.value, "__notes__", []))
    assert wg.fail_on(-1) == [0, 1, 2, 3]  # the group survives a Python exception


def test_infeasible_pool_fails_at_once_naming_asked_and_available(ray_cluster):
    asked = RAY_NUM_CPUS + 4
    pool = RayResourcePool(n_gpus_per_node=asked, use_gpu=False, placement_timeout_s=30)
    start = time.monotonic()
    with pytest.raises(
        UnplaceableResourcePoolError,
        match=rf"Asked for 1 node\(s\) x {asked} bundle\(s\) of \{{CPU=1.0\}}.*CPU={RAY_NUM_CPUS}.0",
    ):
        pool.get_placement_groups()
    assert time.monotonic() - start < 10


def test_busy_pool_fails_within_its_timeout(group):
    # the module's group holds 4 CPUs, so a pool of one bundle more than the rest can only wait
    free = RAY_NUM_CPUS - 4
    pool = RayResourcePool(n_gpus_per_node=free + 1, use_gpu=False, placement_timeout_s=1.5)
    start = time.monotonic()
    with pytest.raises(
        UnplaceableResourcePoolError,
        match=rf"not placed within placement_timeout_s=1.5s.*currently free \{{CPU={free}.0",
    ):
        pool.get_placement_groups()
    elapsed = time.monotonic() - start
    assert 1.5 <= elapsed < 10
