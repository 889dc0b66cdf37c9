"""`WorkerHost`: a worker process that runs one worker object after another, each as in a fresh process.

The worker side of ``testing/worker_hosts.py``: ``host_start`` sets this rank's environment and
constructs the worker; ``host_stop`` drops it and restores what a fresh process would see.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

import torch

from verl_balance.utils.process_state import (
    destroy_process_groups,
    module_globals,
    reset_torch_defaults,
    restore_module_globals,
)

__all__ = ["WorkerHost"]


class WorkerHost:
    """One host process: at most one worker object at a time (the worker group forwards its methods)."""

    def __init__(self) -> None:
        self._start_env = dict(os.environ)
        self._initial_seed = torch.initial_seed()
        self._num_threads = torch.get_num_threads()
        self._saved_globals: list = []
        self._worker: Any = None

    def host_start(self, cls: type, env: dict[str, str], args: tuple, kwargs: dict) -> int:
        """Construct ``cls(*args, **kwargs)`` with this rank's environment; returns the host's pid."""
        assert self._worker is None, "a host serves one worker at a time"
        os.environ.clear()
        os.environ.update({**self._start_env, **env})
        reset_torch_defaults(initial_seed=self._initial_seed, num_threads=self._num_threads)
        self._saved_globals = module_globals()  # the worker's module is imported by now (``cls`` arrived)
        self._worker = cls(*args, **kwargs)
        return os.getpid()

    def host_stop(self) -> bool:
        """Drop the worker and everything it set up, so the next worker sees a fresh process. False: this
        process cannot be reset (e.g. it ran a vLLM engine); the driver kills it."""
        self._worker = None
        reusable = destroy_process_groups() and "vllm" not in sys.modules
        gc.collect()
        restore_module_globals(self._saved_globals)
        os.environ.clear()
        os.environ.update(self._start_env)
        return reusable
