"""Recognising a full disk (or quota) in any write of the run, and naming it: the directory and
its free space; recognised by message anywhere in the exception's cause/context chain."""

from __future__ import annotations

import errno
import os
import shutil

_DISK_FULL_TEXT = (
    "No space left on device",
    "Disk quota exceeded",
    "PytorchStreamWriter failed",
    "unexpected pos",
)


def is_disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` (or an exception in its cause/context chain) is a full disk or quota."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(err) for text in _DISK_FULL_TEXT):
            return True
        err = err.__cause__ or err.__context__
    return False


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def free_space(path: str) -> str:
    """The free space of the filesystem holding ``path`` (or its nearest existing parent), as text."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return f"{format_bytes(shutil.disk_usage(probe).free)} free"
    except OSError as err:
        return f"free space unknown ({err.strerror})"


def disk_full_text(what: str, directory: str) -> str:
    """``no space to <what> in '<directory>' (<free> free)`` plus the ways out."""
    return (
        f"no space to {what} in {os.path.abspath(directory)!r} ({free_space(directory)}): the disk (or quota) is "
        "full. Free space there, or point trainer.default_local_dir at a larger disk"
    )
