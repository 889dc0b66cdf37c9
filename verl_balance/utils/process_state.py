"""What a fresh process would see, restored in a process that runs one job after another.

The warm pools (``testing/multiprocess.py``'s gloo ranks, ``single_controller/worker_hosts.py``'s
Ray worker hosts) run successive jobs in one process to save its start-up. A job must still start
from a fresh process's state where it matters: torch's initial seed, default dtype, grad mode and
thread count, and the module globals an earlier job rebound (a test's ``module.function = stub``
meant for a process that would leave afterwards).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

_MISSING = object()


def module_globals() -> list[tuple[dict, dict]]:
    """(live namespace, copy) of every imported module: what a job may rebind."""
    return [(vars(m), dict(vars(m))) for m in list(sys.modules.values()) if m is not None]


def restore_module_globals(saved: list[tuple[dict, dict]]) -> None:
    """Undo a job's rebinding of module globals; names a job added (submodules, lazy attributes) stay."""
    for live, before in saved:
        for key, value in before.items():
            if live.get(key, _MISSING) is not value:
                live[key] = value


def reset_torch_defaults(*, initial_seed: int, num_threads: int) -> None:
    """torch's process-wide defaults as a fresh process has them (``initial_seed``: the process's own)."""
    torch.set_num_threads(num_threads)
    torch.manual_seed(initial_seed)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def destroy_process_groups() -> None:
    """Leave this process's default process group and its subgroups, if any (a local operation)."""
    if dist.is_initialized():
        dist.destroy_process_group()
