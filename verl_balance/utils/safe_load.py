"""Reading a checkpoint received from elsewhere without running code planted in it.

Every loader of this package reads pickles through this module: DCP ``.metadata`` through
``SafeFileSystemReader`` (only torch's checkpoint metadata types), shard values through
``SafeLoadPlanner`` and ``engine_state.pt`` through ``load_torch_file`` (both ``weights_only=True``).
Anything else is refused with ``UnsafeCheckpointError`` before it can run; files the metadata names
outside the checkpoint directory are refused with ``CheckpointPathError`` before a byte is read.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from verl_balance.utils.confined import check_confined

METADATA_FILE = ".metadata"

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
ALLOWED_METADATA_GLOBALS = frozenset(
    {
        (_METADATA_MODULE, "Metadata"),
        (_METADATA_MODULE, "MetadataIndex"),
        (_METADATA_MODULE, "StorageMeta"),
        (_METADATA_MODULE, "TensorProperties"),
        (_METADATA_MODULE, "TensorStorageMetadata"),
        (_METADATA_MODULE, "BytesStorageMetadata"),
        (_METADATA_MODULE, "ChunkStorageMetadata"),
        (_METADATA_MODULE, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("collections", "OrderedDict"),
    }
)
"""(module, name) pairs a DCP ``.metadata`` pickle may name (plus the ``torch.<dtype>`` objects)."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds a pickle that names something other than plain checkpoint data."""


def _refusal(path: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} is refused: its pickle names {what}, which a checkpoint never holds (loading it could run "
        "code planted in the file). Only load checkpoints from a source you trust, or re-save it with this "
        "version (docs/fault_tolerance.md, 'What a received checkpoint can do')"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only ``ALLOWED_METADATA_GLOBALS`` and torch's dtypes."""

    def __init__(self, file, *, path: str) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _refusal(self._path, f"{module}.{name}")


def read_dcp_metadata(path: str):
    """The DCP ``Metadata`` of checkpoint directory ``path``, read by the restricted unpickler."""
    return SafeFileSystemReader(path).read_metadata()


def storage_paths(metadata) -> list:
    """The file names (relative to the checkpoint directory) the DCP ``metadata`` reads from."""
    data = metadata.storage_data
    if data is None:
        return []
    if not isinstance(data, dict):
        raise UnsafeCheckpointError(f"the DCP metadata's storage_data is a {type(data).__name__}, not a dict")
    return sorted({getattr(info, "relative_path", None) for info in data.values()}, key=str)


class SafeFileSystemReader(dcp.FileSystemReader):
    """torch's ``FileSystemReader`` with a restricted ``.metadata`` unpickler and confined storage paths."""

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        check_confined(os.fspath(self.path), storage_paths(metadata))  # the metadata torch actually reads by
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = os.fspath(self._get_metadata_path(rank))
        check_confined(os.fspath(self.path), [os.path.relpath(path, os.fspath(self.path))])  # not a link
        with open(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, path=path).load()
            except UnsafeCheckpointError:
                raise
            except Exception as err:  # a torn or foreign file: say which
                raise UnsafeCheckpointError(f"{path} is not a DCP metadata file ({err!r})") from err
        if type(metadata).__name__ != "Metadata":
            raise _refusal(path, f"a {type(metadata).__name__} instead of DCP Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        check_confined(os.fspath(self.path), storage_paths(metadata))
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` reading a shard's non-tensor values with ``weights_only=True``."""

    def __init__(self, *args, checkpoint: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._checkpoint = checkpoint

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise _refusal(
                f"the DCP shard value {read_item.dest_index.fqn!r} of checkpoint {self._checkpoint}", str(err)[:300]
            ) from err
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def dcp_load(state: dict, path: str, *, no_dist: bool = False, allow_partial_load: bool = False) -> None:
    """``dcp.load(state, checkpoint_id=path)`` through ``SafeFileSystemReader`` and ``SafeLoadPlanner``;
    any refusal raises ``UnsafeCheckpointError``."""
    read_dcp_metadata(path)
    try:
        with warnings.catch_warnings():  # single-process load is the intent with no_dist, not a mistake
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(path),
                planner=SafeLoadPlanner(checkpoint=path, allow_partial_load=allow_partial_load),
                no_dist=no_dist,
            )
    except CheckpointException as err:
        raise checkpoint_exception_cause(err) from err


def checkpoint_exception_cause(err: CheckpointException) -> Exception:
    """The first rank's own exception inside torch's ``CheckpointException``, or a ``RuntimeError``."""
    for failure in err.failures.values():
        exc = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(exc, Exception):
            return exc
    return RuntimeError(str(err))


def load_torch_file(path: str):
    """``torch.load(path, weights_only=True)`` on the CPU; ``UnsafeCheckpointError`` naming the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise _refusal(path, str(err).splitlines()[0][:300]) from err


def state_mismatch(metadata, wanted: dict, *, prefix: str = "model.", ignore: tuple[str, ...] = ()) -> list[str]:
    """Why ``metadata``'s checkpoint won't load into ``wanted`` (name -> global shape): missing keys,
    unexpected keys under ``prefix`` (minus ``ignore``), shape mismatches; [] when it loads exactly."""
    saved = {k[len(prefix) :]: v for k, v in metadata.state_dict_metadata.items() if k.startswith(prefix)}
    missing = sorted(k for k in wanted if k not in saved)
    unexpected = sorted(k for k in saved if k not in wanted and not k.startswith(ignore))
    shapes = sorted(
        f"{k} {tuple(saved[k].size)} in the checkpoint, {tuple(v.shape)} in the model"
        for k, v in wanted.items()
        if k in saved and hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(v.shape)
    )
    problems = []
    for label, names in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes)):
        if names:
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            problems.append(f"{label} ({len(names)}): {', '.join(names[:4])}{more}")
    return problems
