"""Processes that reward code starts never outlive the run: the processes each reward batch leaves
behind (new direct children, their descendants and their own process groups; never a process started
under one that existed before) are recorded, and ``reap`` ends them at the end of the run (SIGTERM,
then SIGKILL after a grace period).

A process is recognised by its pid *and* start time, so a reused pid is never signalled. Linux only
(``/proc``); elsewhere nothing is recorded. During a batch this process is the child subreaper, so
descendants orphaned during the batch are recorded too.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

_PROC = "/proc"


def _stat(pid: int, *, zombies: bool = False) -> tuple[int, int, int] | None:
    """(ppid, pgid, start time in clock ticks) of ``pid``; None when it is gone (or a zombie, unless ``zombies``)."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X") and not zombies:
        return None
    return int(fields[1]), int(fields[2]), int(fields[19])


def _all_stats(*, zombies: bool = False) -> dict[int, tuple[int, int, int]]:
    """``{pid: (ppid, pgid, start)}`` of every live process this process can see (and zombies, if asked)."""
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_PROC):
            if name.isdigit() and (stat := _stat(int(name), zombies=zombies)) is not None:
                out[int(name)] = stat
    return out


def _settled_stats() -> dict[int, tuple[int, int, int]]:
    """Two passes of ``_all_stats(zombies=True)``, united. A child that forked and exited while the first
    pass listed /proc is a zombie there (its process group still readable), and the process it forked
    (re-parented to this subreaper) is listed by the second."""
    first = _all_stats(zombies=True)
    return {**first, **_all_stats(zombies=True)}


def _descendants(root: int, stats: dict[int, tuple[int, int, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def _set_subreaper(on: bool) -> bool:
    """Make this process the child subreaper (``prctl``) or stop; returns whether it was one."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        state = ctypes.c_int(0)
        libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(state), 0, 0, 0)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
        return bool(state.value)
    except (OSError, AttributeError):
        return False


class RewardChildren:
    """The processes reward calls of this process left running; ``reap`` ends them (idempotent)."""

    def __init__(self) -> None:
        self._tracked: dict[int, int] = {}  # pid -> start time
        self._groups: set[int] = set()  # process groups of their own that reward children made
        self._own_pgid = os.getpgrp()
        atexit.register(self.reap)  # also when the run ends by an error that skips the trainer's close

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Record what the enclosed reward calls leave running."""
        if not os.path.isdir(_PROC):
            yield
            return
        me = os.getpid()
        before = {pid for pid, (ppid, _, _) in _all_stats(zombies=True).items() if ppid == me}
        was_subreaper = _set_subreaper(True)
        try:
            yield
        finally:
            stats = _settled_stats()
            if not was_subreaper:
                _set_subreaper(False)
            new = {pid for pid, (ppid, _, _) in stats.items() if ppid == me and pid not in before}
            for pid in new | {d for child in new for d in _descendants(child, stats)}:  # never Ray's own
                _, pgid, start = stats[pid]
                self._tracked[pid] = start
                if pgid != self._own_pgid:
                    self._groups.add(pgid)

    def _alive(self) -> dict[int, int]:
        """The recorded processes (and members of recorded groups) still running: pid -> start."""
        stats = _all_stats()
        alive = {pid: start for pid, start in self._tracked.items() if pid in stats and stats[pid][2] == start}
        for pid in list(alive):
            alive.update({d: stats[d][2] for d in _descendants(pid, stats)})
        alive.update({pid: s[2] for pid, s in stats.items() if s[1] in self._groups and pid != os.getpid()})
        return alive

    def reap(self, *, grace_s: float = 2.0) -> int:
        """SIGTERM every recorded process still running, SIGKILL those alive after ``grace_s``;
        returns how many there were."""
        alive = self._alive()
        if not alive:
            return 0
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid, start in alive.items():
                if (stat := _stat(pid)) is not None and stat[2] == start:
                    with contextlib.suppress(OSError):
                        os.kill(pid, sig)
            deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
            while time.monotonic() < deadline and self._reap_zombies(alive):
                time.sleep(0.05)
        logger.warning("reward: ended %d process(es) that reward calls left running: %s", len(alive), sorted(alive))
        self._tracked.clear()
        self._groups.clear()
        return len(alive)

    @staticmethod
    def _reap_zombies(pids: dict[int, int]) -> bool:
        """Collect this process's exited children among ``pids``; whether any of them still runs."""
        running = False
        for pid, start in pids.items():
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
            if (stat := _stat(pid)) is not None and stat[2] == start:
                running = True
        return running
