"""Crash-safe small-file writes (a reader sees the old content or the new one, never a torn file),
and the run directory's no-follow writer: a symbolic link or a hard-linked file (``st_nlink > 1``) is
refused with ``UnsafePathError`` before a byte is written."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import uuid

_NOFOLLOW_FLAGS = {
    "a": os.O_WRONLY | os.O_APPEND | os.O_CREAT,
    "w": os.O_WRONLY | os.O_CREAT,  # truncated only after the hard-link check
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "r+": os.O_RDWR | os.O_CREAT,
    "r": os.O_RDONLY,
}


class UnsafePathError(ValueError):
    """A file or directory of the run directory is a symbolic link (or a hard-linked file)."""


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


def _hard_link_error(path: str, links: int) -> UnsafePathError:
    return UnsafePathError(
        f"{path} has {links} hard links: it is the same file as another name outside the run's control, so the "
        "run never writes or reads it (the other file would change too). Remove it (or replace it with a copy), "
        "or point trainer.default_local_dir at another directory"
    )


def open_nofollow_fd(path: str, mode: str = "a", perms: int = 0o644) -> int:
    """``os.open`` of ``path`` with ``O_NOFOLLOW`` (``mode``: a, w, x, r+ or r); a link or a hard-linked
    file raises ``UnsafePathError`` (``w`` truncates only after that check)."""
    try:
        fd = os.open(path, _NOFOLLOW_FLAGS[mode] | os.O_NOFOLLOW | os.O_CLOEXEC, perms)
    except OSError as err:
        if err.errno == errno.ELOOP or (err.errno == errno.EEXIST and os.path.islink(path)):
            raise _link_error(path) from err
        raise
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            raise _hard_link_error(path, st.st_nlink)
        if mode == "w":
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dir_nofollow(path: str) -> str:
    """Create the directory ``path`` (and parents) unless it exists, refusing a symbolic link; returns ``path``."""
    refuse_symlink(path)
    os.makedirs(path, exist_ok=True)
    refuse_symlink(path)  # created by someone else between the two calls
    return path


def open_nofollow(path: str, mode: str = "a", *, encoding: str | None = "utf-8", errors: str | None = None):
    """A file object of ``open_nofollow_fd(path, mode)``."""
    binary = mode.endswith("b")
    base = mode[:-1] if binary else mode
    py_mode = ("r+" if base == "r+" else "w" if base == "x" else base) + ("b" if binary else "")
    if binary:
        return os.fdopen(open_nofollow_fd(path, base), py_mode)
    return os.fdopen(open_nofollow_fd(path, base), py_mode, encoding=encoding, errors=errors)


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


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync it, rename it over ``path``."""
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        fd = open_nofollow_fd(tmp, "x")  # a fresh file: never one planted at this name
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def atomic_write_text(path: str, text: str) -> None:
    """``atomic_write_bytes`` of ``text`` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str, obj, *, indent: int | None = 1) -> None:
    """``atomic_write_text`` of ``obj`` as JSON (non-JSON values as ``str``)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, default=str))
