"""Process-wide state of ``patch_verl``: the workload the drop-ins default to, and the live patches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PatchState:
    """``workload``: set by the innermost active ``patch_verl(workload=...)`` (None: the default
    from ``workload.workload_from_env``); ``stack``: active patch handles, innermost last."""

    workload: Any = None
    stack: list = field(default_factory=list)


PATCH_STATE = PatchState()


def current_workload() -> Any:
    """The workload the drop-ins use when the caller passes none (same rule in every process)."""
    from verl_balance.integrations.verl.patches.workload import workload_from_env

    return PATCH_STATE.workload if PATCH_STATE.workload is not None else workload_from_env()
