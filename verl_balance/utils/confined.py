"""A checkpoint reads only its own files: every name its DCP ``.metadata`` or its manifest holds
must be a plain relative path naming a regular file inside the checkpoint directory.

Refused with ``CheckpointPathError``: an absolute path, a ``..``/``.``/empty component, a symbolic
link below the checkpoint directory, a non-regular file, a name resolving outside, and a file with
more hard links than the checkpoint names it. A name that does not exist passes here. stdlib only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable


class CheckpointPathError(ValueError):
    """A checkpoint names a file outside its directory, a link, or something not a regular file."""


def _refusal(root: str, name: object, why: str) -> CheckpointPathError:
    return CheckpointPathError(
        f"checkpoint {root!r} is refused: it names the file {name!r}, which {why}. A checkpoint reads only "
        "regular files inside its own directory (docs/fault_tolerance.md, 'What a received checkpoint can do'); "
        "copy the checkpoint's files themselves (not links to them) into one directory"
    )


def _inode_names(root: str) -> dict[tuple[int, int], int]:
    """``{(st_dev, st_ino): how many names under root}`` for the regular files under ``root``."""
    counts: dict[tuple[int, int], int] = {}
    for dirpath, _, names in os.walk(root):  # os.walk never descends into a linked directory
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                counts[(st.st_dev, st.st_ino)] = counts.get((st.st_dev, st.st_ino), 0) + 1
    return counts


def _check_name(root: str, real_root: str, name: object) -> os.stat_result | None:
    """The ``lstat`` of the regular file ``name`` inside ``root`` (None when it does not exist)."""
    if not isinstance(name, str) or not name:
        raise _refusal(root, name, "is not a relative file name")
    if os.path.isabs(name) or "\\" in name or "\0" in name:
        raise _refusal(root, name, "is an absolute path (or not a POSIX relative path)")
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise _refusal(root, name, "has an empty, '.' or '..' component")
    current = root
    for i, part in enumerate(parts):
        current = os.path.join(current, part)
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(st.st_mode):
            raise _refusal(root, name, f"goes through the symbolic link {current!r} (to {os.readlink(current)!r})")
        last = i == len(parts) - 1
        if last and not stat.S_ISREG(st.st_mode):
            raise _refusal(root, name, "is not a regular file")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise _refusal(root, name, f"goes through {current!r}, which is not a directory")
    if os.path.commonpath([real_root, os.path.realpath(current)]) != real_root:
        raise _refusal(root, name, "resolves outside the checkpoint directory")
    return st


def check_confined(root: str, names: Iterable[object]) -> None:
    """``CheckpointPathError`` unless every one of ``names`` (relative to the checkpoint directory
    ``root``) is a regular file inside ``root`` reached without a link, or does not exist."""
    real_root = os.path.realpath(root)
    linked = []
    for name in names:
        st = _check_name(root, real_root, name)
        if st is not None and st.st_nlink > 1:
            linked.append((name, st))
    if not linked:
        return
    inside = _inode_names(root)
    for name, st in linked:
        if st.st_nlink > inside.get((st.st_dev, st.st_ino), 0):
            raise _refusal(
                root,
                name,
                f"has {st.st_nlink} hard links but only {inside.get((st.st_dev, st.st_ino), 0)} inside the "
                "checkpoint: it is the same file as one outside it",
            )
