"""What a fresh process would see, restored in a process that runs one job after another.

The warm pools restore: seed, default dtype, grad mode, threads, no process group or DTensor cache, rebound globals.
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


def destroy_process_groups() -> bool:
    """Leave this process's process groups and forget DTensor's caches of their meshes (local operations).

    Returns False where this torch cannot clear those caches: the process must then not serve another job.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    try:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        return False
    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    return True


# Third-party modules the warm gloo ranks' fork server (distributed/launcher.py) imports once for every
# rank it forks; verl and LoRA also import sympy and peft. Not pyarrow (nor pandas or datasets, which
# import it): it starts a thread when imported, and a fork of a process with a second thread may
# inherit a lock that thread held.
FORK_SERVER_PRELOAD = (
    *("torch", "torch.distributed.tensor", "tensordict", "transformers", "transformers.modeling_utils"),
    *("sympy", "peft"),
)


def reseed_like_a_fresh_process() -> None:
    """In a fork: redraw the random states a fresh interpreter would (torch's and numpy's global ones)."""
    sys.modules["torch"].seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
