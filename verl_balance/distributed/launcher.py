"""Run a function on N processes that form a gloo process group; collect the results.

``run_on_ranks(fn, world=N)`` runs ``fn(rank)`` on N processes, each in a fresh gloo group (CPU, one
torch thread), and returns the results in rank order; ``init_group=False`` lets a caller open groups
itself (``gloo_group``).

The processes are a warm pool per world size, forked with third-party modules preloaded (never verl
or verl_balance); each call starts as a fresh process would (caller's environment, cwd, ``sys.path``;
torch's initial seed and defaults). A rank that raises, dies or exceeds ``timeout_s`` fails the call
naming the rank, and then that pool is killed. ``fresh=True`` uses new processes.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_balance.utils.process_state import (
    FORK_SERVER_PRELOAD,
    destroy_process_groups,
    module_globals,
    reseed_like_a_fresh_process,
    reset_torch_defaults,
    restore_module_globals,
)

# A call that takes longer fails naming the ranks that did not answer (env: VERL_BALANCE_RANKS_TIMEOUT_S).
DEFAULT_TIMEOUT_S = float(os.environ.get("VERL_BALANCE_RANKS_TIMEOUT_S", "600"))
# Idle warm processes kept over all world sizes; the least recently used pools are shut down first.
MAX_WARM_PROCESSES = 8


class RankFailedError(RuntimeError):
    """A rank of ``run_on_ranks`` raised, died or did not answer in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for init_method=tcp://)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_RENDEZVOUS_DIR: list[str] = []


def new_rendezvous() -> str:
    """A ``file://`` init_method that no other process group on this machine uses (a free TCP port can
    be taken before rank 0 binds it, merging two groups' stores)."""
    if not _RENDEZVOUS_DIR:
        _RENDEZVOUS_DIR.append(tempfile.mkdtemp(prefix="verl_balance_rendezvous_"))
        atexit.register(shutil.rmtree, _RENDEZVOUS_DIR[0], ignore_errors=True)
    return "file://" + os.path.join(_RENDEZVOUS_DIR[0], uuid.uuid4().hex)


@contextlib.contextmanager
def gloo_group(*, rank: int, world_size: int, init_method: str) -> Iterator[None]:
    """The default process group (gloo, rendezvous at ``init_method``: see ``new_rendezvous``) for the block."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        yield
        # init_process_group returns on a rank before its peers have finished connecting to it; a rank
        # that left the block at once would close its sockets under them ("Connection closed by peer").
        dist.barrier()
    finally:
        # a rank of a later group in this process may hold another coordinate of an equal mesh
        assert destroy_process_groups(), "this torch cannot clear DTensor's mesh caches between groups"


@dataclass(frozen=True)
class _Task:
    fn: bytes  # pickled apart: unpickled after sys.path and the working directory are the caller's
    init_method: str
    init_group: bool
    environ: dict
    cwd: str
    sys_path: list


def _run_task(rank: int, world: int, task: _Task, initial_seed: int):
    """``task.fn(rank)`` with the caller's environment and a fresh process's torch defaults."""
    os.environ.clear()
    os.environ.update(task.environ)
    os.chdir(task.cwd)
    sys.path[:] = task.sys_path
    reset_torch_defaults(initial_seed=initial_seed, num_threads=1)
    assert destroy_process_groups(), "this torch cannot clear DTensor's mesh caches between pooled tasks"
    fn = pickle.loads(task.fn)
    if not task.init_group:
        return fn(rank)
    with gloo_group(rank=rank, world_size=world, init_method=task.init_method):
        return fn(rank)


def _serve(rank: int, world: int, conn: multiprocessing.connection.Connection) -> None:
    """A pool process: run tasks until the pipe closes; after a failure report it and leave."""
    reseed_like_a_fresh_process()  # a fork of the fork server: its own seeds, as a fresh process has
    initial_seed = torch.initial_seed()
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            break
        saved = module_globals()
        try:
            reply = pickle.dumps(("ok", _run_task(rank, world, pickle.loads(payload), initial_seed)))
        except BaseException:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
            break
        restore_module_globals(saved)
        conn.send_bytes(reply)
    # Leave without interpreter teardown: torch's C++ threads (gloo / TCPStore) can abort the process
    # at exit ("terminate called without an active exception", SIGABRT) after the result is sent.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Pool:
    """``world`` processes forked by the fork server, one pipe each."""

    def __init__(self, world: int):
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(FORK_SERVER_PRELOAD))  # read when the fork server starts (the first pool)
        self.world = world
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, world, child), name=f"run_on_ranks-{world}-{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, task: _Task, timeout_s: float | None) -> list:
        payload = pickle.dumps(task)
        for conn in self.conns:
            conn.send_bytes(payload)
        results: dict[int, object] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(results) < self.world:
            pending = [r for r in range(self.world) if r not in results]
            waits = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(waits, timeout=remaining)
            if not ready:
                raise RankFailedError(f"rank(s) {pending} of {self.world} did not answer within {timeout_s} s")
            for rank in pending:
                if self.conns[rank] in ready or self.procs[rank].sentinel in ready:
                    failure, results[rank] = self._receive(rank)
                    if failure:
                        raise RankFailedError(self._failures(failure, rank, results))
        return [results[rank] for rank in range(self.world)]

    def _receive(self, rank: int) -> tuple[str | None, object]:
        """(None, result) or (what went wrong, None) for a rank whose pipe or process is ready."""
        try:
            status, value = pickle.loads(self.conns[rank].recv_bytes())
        except (EOFError, OSError):
            self.procs[rank].join(timeout=5)
            return f"rank {rank} of {self.world} died (exit code {self.procs[rank].exitcode}) before returning", None
        if status == "error":
            return f"rank {rank} of {self.world} raised:\n{value}", None
        return None, value

    def _failures(self, failure: str, failed: int, results: dict, grace_s: float = 10.0) -> str:
        """Every failure in rank order (others get ``grace_s`` to report), so the rank that raised first is named."""
        failures = {failed: failure}
        deadline = time.monotonic() + grace_s
        for rank in range(self.world):
            if rank in results or rank == failed:
                continue
            if multiprocessing.connection.wait([self.conns[rank]], timeout=max(0.0, deadline - time.monotonic())):
                failure, _ = self._receive(rank)
                if failure:
                    failures[rank] = failure
        return "\n".join(failures[rank] for rank in sorted(failures))

    def close(self, *, kill: bool) -> None:
        for conn in self.conns:
            conn.close()  # an idle process reads EOF and leaves
        for proc in self.procs:
            if kill:
                proc.kill()
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


_POOLS: OrderedDict[int, _Pool] = OrderedDict()


def _warm_pool(world: int) -> _Pool:
    pool = _POOLS.pop(world, None)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(kill=True)
        while _POOLS and sum(p.world for p in _POOLS.values()) + world > MAX_WARM_PROCESSES:
            _POOLS.popitem(last=False)[1].close(kill=False)
        pool = _Pool(world)
    _POOLS[world] = pool  # most recently used last
    return pool


@atexit.register
def shutdown_pools() -> None:
    """Stop every warm process (also at interpreter exit)."""
    while _POOLS:
        _POOLS.popitem()[1].close(kill=False)


def run_on_ranks(
    fn: Callable[[int], object],
    *,
    world: int,
    init_group: bool = True,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    fresh: bool = False,
) -> list:
    """fn(rank) on ``world`` processes; returns [result of rank 0, ...].

    fn and its result must be picklable. With init_group (default) every process is in one gloo group of
    ``world`` ranks. Raises RankFailedError when a rank raises, dies or exceeds ``timeout_s``.
    """
    task = _Task(pickle.dumps(fn), new_rendezvous(), init_group, dict(os.environ), os.getcwd(), list(sys.path))
    pool = _Pool(world) if fresh else _warm_pool(world)
    try:
        results = pool.run(task, timeout_s)
    except BaseException:
        if not fresh:
            _POOLS.pop(world, None)
        pool.close(kill=True)
        raise
    if fresh:
        pool.close(kill=False)
    return results
