"""Rank 0's rendezvous address: drawn by the driver on its own node, by a task on another node."""

from __future__ import annotations

from types import SimpleNamespace

from verl_balance.single_controller import worker_group


class _Task:
    """Stands in for the remote task: records that it ran and answers another node's address."""

    def __init__(self) -> None:
        self.calls = 0

    def options(self, **_):
        return self

    def remote(self):
        self.calls += 1
        return ("10.0.0.2", 23456)


def _driver_on(monkeypatch, node: str) -> _Task:
    task = _Task()
    monkeypatch.setattr(worker_group.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: node))
    monkeypatch.setattr(worker_group.ray, "get", lambda ref: ref)
    monkeypatch.setattr(worker_group.ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    monkeypatch.setattr(worker_group, "_node_address_and_free_port", task)
    monkeypatch.setattr(worker_group, "PlacementGroupSchedulingStrategy", lambda **_: None)
    monkeypatch.setattr(worker_group, "free_rendezvous_port", lambda: 31234)
    return task


def test_driver_on_rank0_node_draws_the_port_itself(monkeypatch):
    task = _driver_on(monkeypatch, "node-a")
    assert worker_group._rendezvous_address(None, node_id="node-a") == ("10.0.0.1", 31234)
    assert task.calls == 0


def test_rank0_on_another_node_asks_a_task_there(monkeypatch):
    task = _driver_on(monkeypatch, "node-a")
    assert worker_group._rendezvous_address(None, node_id="node-b") == ("10.0.0.2", 23456)
    assert task.calls == 1
