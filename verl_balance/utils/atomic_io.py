"""Crash-safe small-file writes (a reader sees the old content or the new one, never a torn file),
and opening the run directory's files without following a symbolic link planted there (a link
could point anywhere the run's user may write: ``UnsafePathError`` names the path instead)."""

from __future__ import annotations

import errno
import json
import logging
import os
import uuid

_NOFOLLOW_FLAGS = {
    "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "w": os.O_WRONLY | os.O_TRUNC | os.O_CREAT,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "r+": os.O_RDWR | os.O_CREAT,
}


class UnsafePathError(ValueError):
    """A file or directory of the run directory is a symbolic link: it is never written through."""


def _link_error(path: str) -> UnsafePathError:
    try:
        target = f" (to {os.readlink(path)!r})"
    except OSError:
        target = ""
    return UnsafePathError(
        f"{path} is a symbolic link{target}: files of the run directory are never written through a link "
        "(it could point anywhere). Remove the link, or point trainer.default_local_dir at another directory"
    )


def refuse_symlink(path: str) -> None:
    """``UnsafePathError`` naming ``path`` when it is a symbolic link (dangling ones included)."""
    if os.path.islink(path):
        raise _link_error(path)


def open_nofollow_fd(path: str, mode: str = "a", perms: int = 0o644) -> int:
    """``os.open`` of ``path`` with ``O_NOFOLLOW`` (``mode``: a, w, x or r+); a symbolic link at
    ``path`` raises ``UnsafePathError`` naming it, and its target is left untouched."""
    try:
        return os.open(path, _NOFOLLOW_FLAGS[mode] | os.O_NOFOLLOW | os.O_CLOEXEC, perms)
    except OSError as err:
        if err.errno == errno.ELOOP or (err.errno == errno.EEXIST and os.path.islink(path)):
            raise _link_error(path) from err
        raise


def open_nofollow(path: str, mode: str = "a", *, encoding: str = "utf-8"):
    """A text file object of ``open_nofollow_fd(path, mode)``."""
    return os.fdopen(
        open_nofollow_fd(path, mode), "r+" if mode == "r+" else "w" if mode == "x" else mode, encoding=encoding
    )


class NoFollowFileHandler(logging.FileHandler):
    """``logging.FileHandler`` (append) that refuses a symbolic link at its path (``UnsafePathError``)."""

    def __init__(self, filename: str, *, encoding: str = "utf-8") -> None:
        super().__init__(filename, mode="a", encoding=encoding, delay=True)
        self.stream = self._open()  # opened now, so a planted link fails at set-up, naming the path

    def _open(self):
        return open_nofollow(self.baseFilename, "a", encoding=self.encoding)


def fsync_dir(path: str) -> None:
    """Make a rename/creation inside ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, fsync it, rename it over ``path``."""
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        with open_nofollow(tmp, "x") as f:  # a fresh file: never one planted at this name
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_json(path: str, obj, *, indent: int | None = 1) -> None:
    """``atomic_write_text`` of ``obj`` as JSON (non-JSON values as ``str``)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str))
