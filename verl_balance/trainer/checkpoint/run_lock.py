"""One live run per ``trainer.default_local_dir``: an OS file lock held for the run's life.

``flock`` on ``<dir>/.run.lock``: the kernel releases it when the holder exits or dies, so a stale
file never blocks the next run. The file records the holder's host, pid and start time for the
second run's message. Taken before anything in the directory is read or written; a symlink at
``.run.lock`` is refused (``O_NOFOLLOW``).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from verl_balance.trainer.config import ConfigError
from verl_balance.utils.atomic_io import open_nofollow_fd

LOCK_FILE = ".run.lock"


class RunDirectoryBusyError(ConfigError):
    """Another live run holds ``trainer.default_local_dir``."""


class RunLock:
    """The held lock of one run directory; ``release`` (or process exit) frees it."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd: int | None = fd
        self.path = path

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Unlock and close (idempotent). The file stays: a stale file never blocks."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.release()


def _owner_text(fd: int) -> str:
    try:
        owner = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        owner = {}
    if not isinstance(owner, dict) or "pid" not in owner:
        return "an unidentified process (it has not written its details yet)"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(owner.get("started", 0)))
    return f"pid {owner['pid']} on host {owner.get('host', '?')}, started {started}"


def acquire_run_lock(root: str, *, key: str = "trainer.default_local_dir") -> RunLock:
    """Lock ``root`` for this process without waiting; RunDirectoryBusyError naming ``key`` and the owner if held."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, LOCK_FILE)
    fd = open_nofollow_fd(path, "r+")  # a planted link is refused (UnsafePathError naming it); not inherited
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = _owner_text(fd)
        os.close(fd)
        raise RunDirectoryBusyError(
            f"{key}={os.path.abspath(root)!r} is in use by another live run ({owner}); two runs in one "
            f"directory would overwrite each other's checkpoints. Wait for it to finish, stop it, or point "
            f"{key} at another directory"
        ) from None
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode(), 0)
    os.fsync(fd)
    return RunLock(fd, path)
