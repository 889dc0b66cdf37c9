"""Checksums of a checkpoint's files: the manifest in its completeness record and its verification.

A manifest maps every file of a checkpoint directory (relative POSIX path; the completeness record
excluded) to ``{"size": bytes, "xxh3_128": hex}``. ``share_of`` gives the same split on every rank.
A record without a manifest is *unverified*: only DCP shard lengths are checked.
numpy-free and Ray-free.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import xxhash

COMPLETE_FILE = "checkpoint_complete.json"
HASH_NAME = "xxh3_128"
MANIFEST_KEY = "files"
_CHUNK = 8 << 20


class ChecksumMismatchError(ValueError):
    """A checkpoint file is missing, has another size, or another checksum than its manifest says."""

    def __init__(self, path: str, problems: list[str]):
        self.path, self.problems = path, problems
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        super().__init__(f"checkpoint {path!r} is corrupt: {shown}")


def hash_file(path: str) -> str:
    """The xxh3_128 hex digest of the file's bytes (read in 8 MiB chunks)."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def list_files(root: str) -> dict[str, int]:
    """``{relative path: size}`` of every file under ``root`` except the completeness record."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if rel != COMPLETE_FILE:
                out[rel] = os.path.getsize(full)
    return dict(sorted(out.items()))


def share_of(sizes: dict[str, int], *, rank: int, world: int) -> list[str]:
    """The files rank ``rank`` of ``world`` hashes; every rank computes the same split from ``sizes``."""
    load = [0] * world
    shares: list[list[str]] = [[] for _ in range(world)]
    for name, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        target = min(range(world), key=lambda r: (load[r], r))
        load[target] += size
        shares[target].append(name)
    return shares[rank]


def hash_files(root: str, names: Iterable[str]) -> dict[str, dict]:
    """``{name: {"size", "xxh3_128"}}`` of ``names`` under ``root`` (``{"missing": True}`` for an absent one)."""
    out = {}
    for name in names:
        full = os.path.join(root, name)
        try:
            size = os.path.getsize(full)
            out[name] = {"size": size, HASH_NAME: hash_file(full)}
        except FileNotFoundError:
            out[name] = {"missing": True}
    return out


Hasher = Callable[[str, dict], dict]
"""``hasher(root, {name: size})`` -> ``{name: {"size", "xxh3_128"}}`` of all of them (e.g. by the workers)."""


def local_hasher(root: str, sizes: dict[str, int]) -> dict[str, dict]:
    """A ``Hasher`` that hashes everything in this process, serially."""
    return hash_files(root, sizes)


def build_manifest(root: str, *, hasher: Hasher = local_hasher) -> dict[str, dict]:
    """The manifest of every file now under ``root``; ``hasher`` must cover every file."""
    sizes = list_files(root)
    digests = hasher(root, sizes)
    missing = sorted(set(sizes) - set(digests))
    assert not missing, f"hasher left out {missing[:5]}"
    return {name: {"size": sizes[name], HASH_NAME: digests[name][HASH_NAME]} for name in sizes}


def size_problems(root: str, manifest: dict[str, dict]) -> list[str]:
    """Files of ``manifest`` missing under ``root`` or of another size (stat only, nothing read)."""
    problems = []
    for name, entry in manifest.items():
        full = os.path.join(root, name)
        if not os.path.isfile(full):
            problems.append(f"{full} is missing")
            continue
        size = os.path.getsize(full)
        if size != entry["size"]:
            kind = "size mismatch: truncated" if size < entry["size"] else "size mismatch"
            problems.append(f"{full} has {size} bytes, the manifest says {entry['size']} ({kind})")
    return problems


def manifest_shape_problems(manifest: object) -> list[str]:
    """Why ``manifest`` is not a non-empty mapping of names to ``{"size", "xxh3_128"}``; [] when it is."""
    if not isinstance(manifest, dict):
        return [f"its manifest ({MANIFEST_KEY!r}) is a {type(manifest).__name__}, not a mapping of file names"]
    if not manifest:
        return [f"its manifest ({MANIFEST_KEY!r}) is empty: it vouches for no file"]
    bad = [
        name
        for name, entry in manifest.items()
        if not isinstance(entry, dict)
        or type(entry.get("size")) is not int
        or entry["size"] < 0
        or not isinstance(entry.get(HASH_NAME), str)
    ]
    return [f"its manifest entry for {name!r} is not {{'size': int, '{HASH_NAME}': str}}" for name in bad[:5]]


def _confinement_problems(root: str, manifest: dict[str, dict]) -> list[str]:
    """Names of ``manifest`` outside ``root``, and DCP-read files the manifest does not list."""
    from verl_balance.utils.confined import CheckpointPathError, check_confined
    from verl_balance.utils.safe_load import UnsafeCheckpointError, read_dcp_metadata, storage_paths

    try:
        check_confined(root, manifest)
        for name in manifest:
            if os.path.basename(name) != ".metadata":
                continue
            prefix = os.path.dirname(name)
            dcp_dir = os.path.join(root, prefix)
            try:
                names = [str(p) for p in storage_paths(read_dcp_metadata(dcp_dir))]  # confines them too
            except UnsafeCheckpointError:
                continue  # a planted pickle: every loader refuses it by name when it reads the metadata
            unlisted = [p for p in names if (f"{prefix}/{p}" if prefix else p) not in manifest]
            if unlisted:
                return [f"{os.path.join(root, name)} reads {unlisted[:3]}, which the manifest does not list"]
    except CheckpointPathError as err:
        return [str(err)]
    return []


def verify_manifest(root: str, manifest: dict[str, dict], *, hasher: Hasher = local_hasher) -> None:
    """Raise ``ChecksumMismatchError`` naming every missing, resized or altered file of ``manifest``, or
    why it is no valid manifest."""
    problems = manifest_shape_problems(manifest) or _confinement_problems(root, manifest)
    problems = problems or size_problems(root, manifest)
    if problems:  # no need to read gigabytes to know the checkpoint is unusable
        raise ChecksumMismatchError(root, problems)
    digests = hasher(root, {name: entry["size"] for name, entry in manifest.items()})
    for name, entry in manifest.items():
        got = digests.get(name, {})
        if got.get("missing"):
            problems.append(f"{os.path.join(root, name)} is missing")
        elif got.get(HASH_NAME) != entry[HASH_NAME]:
            problems.append(
                f"{os.path.join(root, name)} has {HASH_NAME} {got.get(HASH_NAME)}, the manifest says "
                f"{entry[HASH_NAME]} (checksum mismatch: the bytes changed)"
            )
    if problems:
        raise ChecksumMismatchError(root, problems)


def dcp_truncated_files(root: str) -> list[str]:
    """DCP shard files under ``root`` shorter than their ``.metadata`` byte ranges (missing ones included)."""
    from verl_balance.utils.confined import CheckpointPathError
    from verl_balance.utils.safe_load import UnsafeCheckpointError, read_dcp_metadata

    try:
        metadata = read_dcp_metadata(root)  # never unpickles anything but DCP metadata; confines its paths
    except (UnsafeCheckpointError, CheckpointPathError):
        raise
    except Exception:
        return []
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    problems = []
    for rel, end in sorted(needed.items()):
        full = os.path.join(root, rel)
        if not os.path.isfile(full):
            problems.append(f"{full} is missing")
        elif os.path.getsize(full) < end:
            problems.append(f"{full} has {os.path.getsize(full)} bytes, its DCP metadata needs {end} (truncated)")
    return problems
