"""A worker process that dies mid-call surfaces in the driver as an error naming it, without a hang."""

from __future__ import annotations

import faulthandler
import os
import re
import sys
import time

import pytest
import torch
import torch.distributed as dist
from ray import cloudpickle

from tests.conftest import NATIVE_CRASH_OF_A_WORKER
from verl_balance.single_controller import (
    Dispatch,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    WorkerDiedError,
    register,
)

pytestmark = pytest.mark.slow  # Ray worker processes

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class CrashingWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_dist(self) -> None:
        dist.init_process_group("gloo", init_method="env://", rank=self.rank, world_size=self.world_size)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def all_reduce_or_die(self, dying_rank: int) -> float:
        if self.rank == dying_rank:
            os._exit(3)
        value = torch.ones(1)
        dist.all_reduce(value)  # blocks (or fails with a connection error) on the survivors
        return value.item()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def segfault_after_a_last_word(self, dying_rank: int) -> None:
        print(f"rank {self.rank}: last word before the crash", file=sys.stderr, flush=True)
        if self.rank == dying_rank:
            faulthandler._sigsegv()  # a native crash: what a heap corruption in a library looks like

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def raise_then_peer_dies(self) -> int:
        if self.rank == 0:
            raise RuntimeError("connection closed by peer")  # what a survivor of a dead peer often sees first
        time.sleep(0.5)
        os._exit(3)


def test_killed_worker_raises_naming_rank_actor_and_method(ray_cluster):
    pool = RayResourcePool(n_gpus_per_node=2, use_gpu=False)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(CrashingWorker))
    try:
        wg.init_dist()
        dying_actor = wg.workers[1]._actor_id.hex()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            wg.all_reduce_or_die(1)
        assert time.monotonic() - start < 30
        error = info.value
        assert (error.rank, error.actor_id, error.method) == (1, dying_actor, "all_reduce_or_die")
        message = str(error)
        assert "worker rank 1" in message and dying_actor in message and "CrashingWorker.all_reduce_or_die" in message
        assert not re.search(NATIVE_CRASH_OF_A_WORKER, f"WorkerDiedError: {message}")  # an exit is not rerun
    finally:
        wg.shutdown()
        pool.remove()


def test_dead_peer_is_reported_even_when_a_survivor_errors_first(ray_cluster):
    pool = RayResourcePool(n_gpus_per_node=2, use_gpu=False)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(CrashingWorker))
    try:
        with pytest.raises(
            WorkerDiedError, match="worker rank 1 .* died during CrashingWorker.raise_then_peer_dies"
        ) as info:
            wg.raise_then_peer_dies()
        assert any("worker rank 0 raised meanwhile" in note for note in info.value.__notes__)
        assert isinstance(info.value.__cause__, RuntimeError)  # the survivor's error is kept as the cause
    finally:
        wg.shutdown()
        pool.remove()


def test_a_segfaulted_worker_is_reported_with_the_last_lines_of_its_own_stderr(ray_cluster):
    pool = RayResourcePool(n_gpus_per_node=2, use_gpu=False)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(CrashingWorker))
    try:
        with pytest.raises(WorkerDiedError) as info:
            wg.segfault_after_a_last_word(1)
        message = str(info.value)
        assert "rank 1: last word before the crash" in message
        assert "Segmentation fault" in message  # Python's fault handler, which Ray enables in its workers
        assert "rank 0: last word" not in message  # the dead rank's own log, not a survivor's
        assert re.search(NATIVE_CRASH_OF_A_WORKER, f"WorkerDiedError: {message}")  # the suite reruns such a test
    finally:
        wg.shutdown()
        pool.remove()
