"""The one seam through which a worker group's processes can come from somewhere else than a new Ray
actor per worker: a process-wide ``WorkerFactory``, installed by whoever owns that pool.

Invariants:
- With no factory installed (production), ``RayWorkerGroup`` starts one Ray actor per worker in the
  group's placement group and kills them at ``shutdown``.
- An installed factory is asked per group (``accepts``) and, when it accepts, starts every worker of
  that group (``start_worker``: a handle answering the worker's methods, and the ref of its
  construction, which the group's start-up waits on) and takes them back at ``shutdown``
  (``release(handles, clean=...)``; ``clean=False`` after any failure of the group).
- This module knows no implementation: the suite's warm-host pool (``testing/worker_hosts.py``)
  installs itself here, and nothing outside ``testing/`` and ``tests/`` imports it.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["WorkerFactory", "install_worker_factory", "installed_worker_factory"]


class WorkerFactory(Protocol):
    def accepts(self, cls: type, *, use_gpu: bool, has_extension: bool) -> bool:
        """Whether this factory starts the workers of a group of ``cls``."""

    def start_worker(self, cls: type, *, options: dict, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        """(worker handle, ref of its construction) for one worker with the group's actor ``options``."""

    def release(self, handles: list[Any], *, clean: bool) -> None:
        """Take back a group's workers at its shutdown."""


_INSTALLED: list[WorkerFactory] = []


def install_worker_factory(factory: WorkerFactory | None) -> WorkerFactory | None:
    """Install ``factory`` for the groups built from now on (None: one actor per worker); returns the previous one."""
    previous = _INSTALLED[-1] if _INSTALLED else None
    _INSTALLED[:] = [] if factory is None else [factory]
    return previous


def installed_worker_factory() -> WorkerFactory | None:
    return _INSTALLED[-1] if _INSTALLED else None
