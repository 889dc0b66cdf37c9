"""Every access to verl's private internals, behind one version check.

Private names (underscore attributes, the ``register`` decorator's magic attribute) and the
attributes we replace in verl's modules and classes can change in any verl release. Each accessor
here first checks ``verl.__version__`` against ``SUPPORTED_VERL`` (the ``verl`` extra's pin) and
raises ``VerlVersionError``, one line naming the installed and the supported versions, outside it.
No other module of the integration touches a private verl name.
"""

from __future__ import annotations

import functools
from typing import Any

from packaging.version import InvalidVersion, Version

from verl_balance.integrations.verl.errors import INSTALL_HINT, require_verl

__all__ = [
    "SUPPORTED_VERL",
    "VERL_MAGIC_ATTR",
    "VerlVersionError",
    "check_verl_version",
    "class_options",
    "engine_registry",
    "hf_entry_identity",
    "register_dispatch_collect_info",
    "register_rollout_class",
    "replace_attribute",
    "required_batch_multiple",
    "select_platform",
    "trainer_dp_size",
    "verl_registration",
    "worker_group_dp_size",
]

SUPPORTED_VERL = ">=0.9,<0.10"
"""The verl releases whose private names this module was written against (0.10 development
snapshots compare below 0.10 and are accepted)."""
_LOWEST, _BELOW = Version("0.9"), Version("0.10")

VERL_MAGIC_ATTR = "attrs_3141562937"
"""The attribute verl's ``register`` sets on a worker method (a dict of dispatch/execute/blocking)."""


class VerlVersionError(ImportError):
    """The installed verl is outside ``SUPPORTED_VERL``."""


@functools.lru_cache(maxsize=8)
def _check(version: str) -> None:
    try:
        ok = _LOWEST <= Version(version) < _BELOW
    except InvalidVersion:
        ok = False
    if not ok:
        raise VerlVersionError(
            f"verl_balance.integrations.verl supports verl {SUPPORTED_VERL}, but verl {version} is installed; "
            f"install a supported verl: {INSTALL_HINT}"
        )


def check_verl_version() -> str:
    """The installed ``verl.__version__``; VerlVersionError when it is outside ``SUPPORTED_VERL``."""
    version = str(getattr(require_verl(), "__version__", "unknown"))
    _check(version)
    return version


def replace_attribute(owner: Any, name: str, value: Any) -> Any:
    """Set ``owner.name`` (a verl module or class) to ``value``; returns what ``owner`` itself held."""
    check_verl_version()
    original = owner.__dict__[name]
    setattr(owner, name, value)
    return original


def hf_entry_identity() -> Any:
    """``verl.workers.engine.utils._hf_entry_identity`` (ImportError when this verl lacks it)."""
    check_verl_version()
    from verl.workers.engine.utils import _hf_entry_identity

    return _hf_entry_identity


def register_rollout_class(name: str, mode: str, qualname: str) -> None:
    """Enter ``qualname`` in verl's rollout-class table (``rollout.base._ROLLOUT_REGISTRY``)."""
    check_verl_version()
    from verl.workers.rollout import base

    base._ROLLOUT_REGISTRY[(name, mode)] = qualname


def select_platform(platform_cls: type) -> None:
    """Make an instance of ``platform_cls`` verl's current platform unless one already is (no warning)."""
    check_verl_version()
    from verl.plugin.platform import platform_manager

    if not isinstance(platform_manager._current_platform, platform_cls):
        platform_manager._current_platform = platform_cls()


def engine_registry(registry_cls: type) -> dict:
    """verl's ``EngineRegistry`` table: model type -> backend -> device -> engine class."""
    check_verl_version()
    return registry_cls._engines


def worker_group_dp_size(worker_group: Any, role: str) -> int:
    """The DP size of ``role`` in a verl worker group, through its cached dispatch info (as verl's
    trainers read it)."""
    check_verl_version()
    if role not in worker_group._dispatch_info:
        worker_group._dispatch_info[role] = worker_group._query_dispatch_info(role)
    return max(worker_group._dispatch_info[role]) + 1


def trainer_dp_size(trainer: Any, worker_group: Any, role: str) -> int:
    """verl's legacy ``RayPPOTrainer._get_dp_size``."""
    check_verl_version()
    return trainer._get_dp_size(worker_group, role)


def required_batch_multiple(trainer: Any, dp_size: int) -> int:
    """verl's v1 ``PPOTrainer._get_required_batch_multiple``."""
    check_verl_version()
    return trainer._get_required_batch_multiple(dp_size)


def register_dispatch_collect_info(worker: Any, mesh_name: str, *, dp_rank: int, is_collect: bool) -> None:
    """verl's ``Worker._register_dispatch_collect_info`` (the mesh table verl's dispatch reads)."""
    check_verl_version()
    worker._register_dispatch_collect_info(mesh_name, dp_rank=dp_rank, is_collect=is_collect)


def class_options(value: Any) -> dict:
    """The actor options of verl's ``RayClassWithInitArgs`` (``_options``)."""
    check_verl_version()
    return dict(getattr(value, "_options", {}) or {})


def verl_registration(func: Any) -> dict | None:
    """What verl's ``register`` stored on ``func`` (dispatch/execute/blocking), None if unmarked."""
    attrs = getattr(func, VERL_MAGIC_ATTR, None)
    if attrs is not None:
        check_verl_version()
    return attrs
