"""Declared group methods (``@group_method``) without Ray workers: a declaration must name a
registered worker method (checked before anything starts), its signature is checked on the driver,
and a call runs the worker method's registration; undeclared registered methods are bound by name."""

from __future__ import annotations

import pytest

from verl_balance.single_controller import Dispatch, RayResourcePool, Worker, register
from verl_balance.single_controller.modes import Registration
from verl_balance.single_controller.worker_group import (
    BoundGroupMethod,
    GroupFuture,
    RayClassWithInitArgs,
    RayWorkerGroup,
    WorkerGroupError,
    group_method,
)


class EchoWorker(Worker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def echo(self, value: int, scale: int = 1) -> int:
        return value * scale


class EchoGroup(RayWorkerGroup):
    @group_method
    def echo(self, value: int, scale: int = 1) -> list[int]:
        """``EchoWorker.echo`` on every rank."""
        ...


class WrongGroup(RayWorkerGroup):
    @group_method
    def missing(self) -> None:
        """Not a method of EchoWorker."""
        ...


def test_a_declaration_without_a_registered_worker_method_fails_before_any_worker_starts():
    pool = RayResourcePool([2], use_gpu=False)
    with pytest.raises(WorkerGroupError, match=r"declares \['missing'\] but EchoWorker registers no such"):
        WrongGroup(pool, RayClassWithInitArgs(EchoWorker))
    assert pool.pgs is None  # nothing was placed


def _unstarted(group_cls: type, worker_cls: type, calls: list) -> RayWorkerGroup:
    """A group bound to ``worker_cls`` whose calls are recorded instead of sent to workers."""
    group = group_cls.__new__(group_cls)
    group._extension = None
    group._bind_registered_methods(worker_cls)

    def record(method, registration, args, kwargs):
        calls.append((method, registration.dispatch_mode, args, kwargs))
        return GroupFuture(group, method, [], [], lambda outputs: "collected")

    group._call = record
    group._wait = lambda method, refs, ranks, timeout_s=None: []
    return group


def test_declared_method_checks_its_signature_and_runs_the_registration():
    calls: list = []
    group = _unstarted(EchoGroup, EchoWorker, calls)
    assert isinstance(group.echo, BoundGroupMethod) and "echo" not in vars(group)  # declared, not setattr
    assert group.echo(3, scale=2) == "collected"
    assert calls == [("echo", Dispatch.ONE_TO_ALL, (3,), {"scale": 2})]
    with pytest.raises(TypeError, match="EchoGroup.echo"):
        group.echo(1, 2, 3)
    assert len(calls) == 1  # refused on the driver, nothing dispatched
    assert isinstance(group.echo.submit(4), GroupFuture) and calls[-1][2] == (4,)


def test_generic_group_binds_registered_methods_by_name():
    calls: list = []
    group = _unstarted(RayWorkerGroup, EchoWorker, calls)
    assert "echo" in vars(group) and group.echo(5) == "collected"
    assert group.method_names == ["_query_mesh_info", "echo", "get_rank_info"]
    assert isinstance(group._registrations["echo"], Registration)
