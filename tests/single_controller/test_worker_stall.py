"""No silent stall: a stopped (SIGSTOP) worker produces heartbeat lines naming its rank, then a
WorkerTimeoutError naming rank, method and time; the same call on running workers answers with no
heartbeat (negative control)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import pytest
from ray import cloudpickle

from verl_balance.single_controller import (
    Dispatch,
    RayClassWithInitArgs,
    RayResourcePool,
    RayWorkerGroup,
    Worker,
    WorkerTimeoutError,
    register,
)

pytestmark = pytest.mark.slow  # Ray worker processes

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class PidWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


def test_stopped_worker_gets_heartbeats_naming_it_then_a_timeout_error(ray_cluster, caplog):
    pool = RayResourcePool(n_gpus_per_node=2, use_gpu=False)
    wg = RayWorkerGroup(
        resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(PidWorker), call_timeout_s=6.0, heartbeat_s=1.0
    )
    pids = wg.pid()
    try:
        with caplog.at_level(logging.INFO, logger="verl_balance.single_controller.worker_group"):
            caplog.clear()  # start-up may have waited (heartbeats) on a loaded machine
            assert wg.pid() == pids  # negative control: running workers answer, no heartbeat
            assert "still waiting" not in caplog.text
            os.kill(pids[1], signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(WorkerTimeoutError) as info:
                wg.pid()
            elapsed = time.monotonic() - start
        error = info.value
        assert (error.ranks, error.method) == ([1], "pid")
        assert 6.0 <= error.elapsed_s and elapsed < 30
        assert "PidWorker.pid: worker rank(s) [1] did not finish within 6 s" in str(error)
        beats = [r for r in caplog.records if "still waiting for PidWorker.pid" in r.getMessage()]
        assert len(beats) >= 3, caplog.text
        assert all("worker rank(s) [1] have not answered" in r.getMessage() for r in beats)
        assert all(f"pid {pids[1]} stopped" in r.getMessage() for r in beats)  # the state tells why
        assert f"pid {pids[1]} stopped" in str(error)
        assert all(r.levelno == logging.WARNING for r in beats)  # rank 0 answered, rank 1 did not
    finally:
        os.kill(pids[1], signal.SIGCONT)
        wg.shutdown()
        pool.remove()
