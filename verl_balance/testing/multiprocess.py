"""Run a function on N spawned processes that form a gloo process group; collect the results.

One helper for every multi-process test: ``run_on_ranks(fn, world=N)`` spawns N processes once,
each joins a fresh gloo group (CPU, one torch thread), runs ``fn(rank)`` and pickles its result;
the caller gets ``[result of rank 0, ..., result of rank N-1]``. A process that raises fails the
spawn (its traceback is re-raised here); one that returns leaves with ``os._exit(0)`` once its result
is on disk, skipping the interpreter teardown that can abort in torch's C++ threads. Callers that
need several groups of different sizes in one spawn (the parity harness) pass ``init_group=False``
and open each group with ``gloo_group``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for init_method=tcp://)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def gloo_group(*, rank: int, world_size: int, port: int) -> Iterator[None]:
    """The default process group (gloo over TCP on ``port``) for the duration of the block."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _entry(rank: int, world: int, port: int, fn: Callable, out_dir: str, init_group: bool) -> None:
    torch.set_num_threads(1)
    if init_group:
        with gloo_group(rank=rank, world_size=world, port=port):
            result = fn(rank)
    else:
        result = fn(rank)
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # Leave without interpreter teardown: torch's C++ threads (gloo / TCPStore) can abort the process
    # at exit ("terminate called without an active exception", SIGABRT) after the result is written,
    # failing a finished run at random (3 of 12 runs of tests/engine/test_temperature.py here).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_on_ranks(fn: Callable[[int], object], *, world: int, init_group: bool = True) -> list:
    """fn(rank) on ``world`` spawned processes; returns [result of rank 0, ...].

    fn must be picklable (a module-level function or a functools.partial of one) and so must its
    result. With init_group (default) every process is inside one gloo group of ``world`` ranks.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(world, free_port(), fn, out_dir, init_group), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(out_dir, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results
