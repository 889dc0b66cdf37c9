"""Torch threads of a worker: the pool's setting, the group's environment, the Worker's pool size."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from verl_balance.single_controller import RayResourcePool, Worker
from verl_balance.single_controller.resource_pool import UnplaceableResourcePoolError
from verl_balance.single_controller.worker import NUM_THREADS_ENV, resolve_num_threads
from verl_balance.single_controller.worker_group import _rendezvous_env, cpu_thread_env
from verl_balance.trainer.grpo.async_trainer import AsyncGRPOTrainer


@pytest.mark.parametrize(
    ("value", "cores", "expected"),
    [
        ("3", 8, 3),  # a fixed count ignores the cores
        ("0", 8, 1),  # never fewer than one thread
        ("cores/1", 2, 2),  # one worker on two cores: both
        ("cores/2", 8, 4),
        ("cores/3", 8, 2),  # floor: never more threads than cores in all
        ("cores/4", 2, 1),  # more workers than cores: one each, not zero
    ],
)
def test_resolve_num_threads(value, cores, expected):
    assert resolve_num_threads(value, cores=cores) == expected


def test_core_share_defaults_to_this_process_affinity():
    cores = len(os.sched_getaffinity(0))
    assert resolve_num_threads("cores/1") == cores
    assert resolve_num_threads("cores/1") != resolve_num_threads("cores/1", cores=cores + 1)  # negative control


def _pool(**kwargs) -> RayResourcePool:
    return RayResourcePool(n_gpus_per_node=kwargs.pop("n", 1), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "threads", "omp"),
    [
        (dict(use_gpu=False), "cores/1", "1"),  # the default on CPU: share the node's cores
        (dict(n=2, use_gpu=False, max_colocate_count=2), "cores/4", "1"),  # colocated groups share them too
        (dict(use_gpu=False, cpus_per_worker=2.0), "2", "2"),  # an explicit reservation is the count
        (dict(use_gpu=False, cpus_per_worker=0.5), "1", "1"),
        (dict(use_gpu=True), "1", "1"),  # GPU workers keep one thread per reserved CPU
    ],
)
def test_pool_thread_setting_reaches_the_worker_env(kwargs, threads, omp):
    pool = _pool(**kwargs)
    assert pool.threads_per_worker == threads
    env = _rendezvous_env(pool, rank=0, local_rank=0, address=("127.0.0.1", 1))
    assert env[NUM_THREADS_ENV] == threads and env["OMP_NUM_THREADS"] == omp


def test_default_cpu_reservation_is_unchanged():
    assert _pool(use_gpu=False).bundle() == {"CPU": 1.0}
    assert _pool(use_gpu=False, cpus_per_worker=3.0).bundle() == {"CPU": 3.0}


@pytest.mark.parametrize("value", ["cores/1", "1"])
def test_worker_sizes_torch_pool(monkeypatch, value):
    before = torch.get_num_threads()
    monkeypatch.setenv(NUM_THREADS_ENV, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        Worker()
        assert torch.get_num_threads() == resolve_num_threads(value)
        assert os.environ["OMP_NUM_THREADS"] == str(resolve_num_threads(value))
    finally:
        torch.set_num_threads(before)


def test_cpu_workers_take_the_drivers_wait_policy_else_openmps_default(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cpu_thread_env(_pool(use_gpu=False)) == {}  # OpenMP's default: a bounded spin
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert cpu_thread_env(_pool(use_gpu=False)) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_thread_env(_pool(use_gpu=True)) == {}  # GPU workers: OpenMP's default


@pytest.mark.parametrize("cores", [1, 2, 3, 8, 16])
@pytest.mark.parametrize(("actor", "rollout"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 4)])
def test_pools_computing_at_once_never_hold_more_threads_than_cores(cores, actor, rollout):
    """separate_async's actor and rollout pools on one node: the threads of all workers sum to at most
    the cores (or one each where there are more workers than cores)."""
    sharers = actor + rollout
    pools = [
        _pool(n=actor, use_gpu=False, cpu_workers_per_node=sharers),
        _pool(n=rollout, use_gpu=False, cpu_workers_per_node=sharers),
    ]
    total = sum(p.n_gpus_per_node * resolve_num_threads(p.threads_per_worker, cores=cores) for p in pools)
    assert total == sharers * max(1, cores // sharers) <= max(cores, sharers)


def test_pools_counted_alone_oversubscribe_the_cores():
    """Negative control of the above: each pool sized as if alone takes both cores for itself."""
    pools = [_pool(n=1, use_gpu=False), _pool(n=1, use_gpu=False)]
    assert sum(resolve_num_threads(p.threads_per_worker, cores=2) for p in pools) == 4


def test_two_workers_on_two_cores_get_one_thread_each():
    pool = _pool(n=2, use_gpu=False)
    assert [resolve_num_threads(pool.threads_per_worker, cores=2)] * 2 == [1, 1]


def test_cpu_workers_per_node_below_the_pool_own_workers_is_refused():
    with pytest.raises(UnplaceableResourcePoolError, match="cpu_workers_per_node=1 is fewer than this pool's own 2"):
        _pool(n=2, use_gpu=False, cpu_workers_per_node=1)


@pytest.mark.parametrize(("mode", "expected"), [("separate_async", 3), ("colocate_async", None), ("sync", None)])
def test_async_trainer_counts_the_rollout_pool_beside_the_actor(mode, expected):
    trainer = SimpleNamespace(
        config=SimpleNamespace(trainer=SimpleNamespace(v1=SimpleNamespace(trainer_mode=mode))),
        trainer_config=SimpleNamespace(n_gpus_per_node=2),
        rollout_cfg=SimpleNamespace(n_gpus_per_node=1),
    )
    assert AsyncGRPOTrainer.cpu_workers_per_node(trainer) == expected
