"""The driver-side worker groups against the worker classes (no Ray): every method ``ActorGroup`` /
``ActorRolloutGroup`` declares is a registered worker method, every registered actor method is
declared, and a declared method is found on the group class itself (what "go to definition" finds)."""

from __future__ import annotations

import inspect

import pytest

from verl_balance.single_controller.decorator import get_registration
from verl_balance.single_controller.worker_group import GroupMethod, RayWorkerGroup, declared_group_methods
from verl_balance.workers.actor import ActorWorker
from verl_balance.workers.actor_rollout import ActorRolloutWorker
from verl_balance.workers.group import ActorGroup, ActorRolloutGroup, group_class_for


@pytest.mark.parametrize("group_cls, worker_cls", [(ActorGroup, ActorWorker), (ActorRolloutGroup, ActorRolloutWorker)])
def test_every_declared_group_method_is_a_registered_worker_method(group_cls, worker_cls):
    names = declared_group_methods(group_cls)
    assert names, "the group declares no worker methods"
    for name in names:
        method = getattr(worker_cls, name, None)
        assert method is not None and get_registration(method) is not None, f"{worker_cls.__name__}.{name}"


def test_every_registered_actor_method_is_declared():
    # the workers' own methods (the Worker base's infrastructure methods are not the driver's API)
    registered = {
        name
        for cls in (ActorWorker, ActorRolloutWorker)
        for name, value in vars(cls).items()
        if callable(value) and get_registration(value) is not None
    }
    declared = set(declared_group_methods(ActorRolloutGroup))
    assert registered <= declared, registered - declared
    assert set(declared_group_methods(ActorGroup)) < declared  # the rollout group adds its own


def test_declared_methods_are_defined_in_the_group_module_with_the_driver_signature():
    declaration = vars(ActorGroup)["update_actor"]
    assert isinstance(declaration, GroupMethod) and ActorGroup.update_actor is declaration
    source_file = inspect.getsourcefile(declaration.declaration)
    assert source_file is not None and source_file.endswith("workers/group.py")
    assert list(inspect.signature(declaration.declaration).parameters) == ["self", "chunks"]
    assert "ActorWorker.update_actor" in (declaration.__doc__ or "")


def test_group_class_for_picks_the_declaring_group():
    class Extra(ActorWorker):
        pass

    assert group_class_for(ActorWorker) is ActorGroup
    assert group_class_for(Extra) is ActorGroup
    assert group_class_for(ActorRolloutWorker) is ActorRolloutGroup
    assert group_class_for(object) is RayWorkerGroup


def test_engine_group_declares_once_what_the_actor_and_critic_groups_share():
    from verl_balance.workers.group import CriticGroup, EngineGroup

    shared = set(declared_group_methods(ActorGroup)) & set(declared_group_methods(CriticGroup))
    assert shared == {
        "init_model",
        "eval_loss",
        "describe",
        "save_checkpoint",
        "load_checkpoint",
        "hash_checkpoint_files",
    }
    assert set(declared_group_methods(EngineGroup)) == shared
    for group_cls in (ActorGroup, ActorRolloutGroup, CriticGroup):
        own = {name for name, value in vars(group_cls).items() if isinstance(value, GroupMethod)}
        assert own and not own & shared, (group_cls.__name__, own & shared)  # declared on the base only
