"""The driver-side ActorGroup protocols against the worker classes (no Ray): every protocol
method is a registered worker method, so a call typed by the protocol reaches a real worker method."""

from __future__ import annotations

import inspect

import pytest

from verl_balance.single_controller.decorator import get_registration
from verl_balance.workers.actor import ActorWorker
from verl_balance.workers.actor_rollout import ActorRolloutWorker
from verl_balance.workers.group import ActorGroup, ActorRolloutGroup

GROUP_ONLY = {"shutdown"}  # methods of the worker group itself, not of a worker


def _protocol_methods(protocol) -> set[str]:
    return {name for name, value in vars(protocol).items() if inspect.isfunction(value) and not name.startswith("_")}


@pytest.mark.parametrize("protocol, worker_cls", [(ActorGroup, ActorWorker), (ActorRolloutGroup, ActorRolloutWorker)])
def test_every_protocol_method_is_a_registered_worker_method(protocol, worker_cls):
    names = _protocol_methods(protocol) - GROUP_ONLY
    assert names, "the protocol declares no worker methods"
    for name in names:
        method = getattr(worker_cls, name, None)
        assert method is not None and get_registration(method) is not None, f"{worker_cls.__name__}.{name}"


def test_every_registered_actor_method_is_in_the_protocols():
    # the workers' own methods (the Worker base's infrastructure methods are not the driver's API)
    registered = {
        name
        for cls in (ActorWorker, ActorRolloutWorker)
        for name, value in vars(cls).items()
        if callable(value) and get_registration(value) is not None
    }
    declared = _protocol_methods(ActorGroup) | _protocol_methods(ActorRolloutGroup)
    assert registered <= declared, registered - declared
