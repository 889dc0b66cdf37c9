"""`Batch`: the unit of data exchanged between the driver and its workers.

A Batch holds B rows: ``tensors`` (a ``TensorDict``, ``batch_size == [B]``), ``non_tensors``
(``dict[str, np.ndarray]`` of length B) and ``meta`` (a plain dict, not indexed by row).

Invariants (checked on construction and by every operation):
- every tensor and every non-tensor column has exactly B rows;
- row operations apply the same row selection to tensors and non-tensors;
- ``meta`` is shared (shallow-copied) into derived batches, never indexed;
- a pickled Batch arrives with its tensors on the CPU.

As verl's ``DataProto``: ``union``, ``reorder`` and ``to`` act in place and return ``self``; every
other operation returns a new Batch sharing tensor storage.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from verl_balance.batch_keys import MICRO_BATCH_SIZES_KEY

__all__ = ["Batch", "BatchError", "UnknownKeyError"]


class BatchError(ValueError):
    """A Batch operation was given inconsistent data (sizes, keys, indices)."""


class UnknownKeyError(BatchError, KeyError):
    """A requested column or meta key does not exist; the message lists the valid keys."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def _as_column(name: str, value: Any) -> np.ndarray:
    """A non-tensor column as a 1-row-per-sample numpy array (lists become object arrays)."""
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise BatchError(f"non-tensor column {name!r} is a 0-d array; it needs one entry per row")
        return value
    if isinstance(value, torch.Tensor):
        raise BatchError(f"non-tensor column {name!r} is a torch.Tensor; put it in `tensors`")
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise BatchError(
            f"non-tensor column {name!r} must be a sequence with one entry per row, got {type(value).__name__}"
        )
    items = list(value)
    column = np.empty(len(items), dtype=object)
    # element-wise assignment keeps nested lists as objects instead of adding array dimensions
    for i, item in enumerate(items):
        column[i] = item
    return column


def _values_equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a.cpu(), b.cpu()))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except Exception:  # noqa: BLE001 - incomparable object arrays are simply unequal
            return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001
        return False


def _check_keys(kind: str, requested: Iterable[str] | None, available: Iterable[str]) -> list[str] | None:
    if requested is None:
        return None
    if isinstance(requested, str):
        requested = [requested]
    requested = list(requested)
    available = list(available)
    missing = [k for k in requested if k not in available]
    if missing:
        raise UnknownKeyError(f"unknown {kind} key(s) {missing}; available: {sorted(available)}")
    return requested


class Batch:
    """B rows of tensors (TensorDict or mapping), non-tensor numpy columns and a meta dict (B = 0 if none)."""

    __slots__ = ("_tensors", "_non_tensors", "_meta")

    def __init__(
        self,
        tensors: TensorDict | Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        non_tensor_columns = {str(k): _as_column(str(k), v) for k, v in (non_tensors or {}).items()}
        if isinstance(tensors, TensorDict):
            if tensors.batch_dims != 1:
                raise BatchError(
                    f"tensors must have exactly one batch dimension, got batch_size={list(tensors.batch_size)}"
                )
            for key in tensors.keys():
                if not isinstance(key, str):
                    raise BatchError(f"nested TensorDict keys are not supported, got {key!r}")
            tensor_dict = tensors
        else:
            tensor_map = dict(tensors or {})
            for key, value in tensor_map.items():
                if not isinstance(value, torch.Tensor):
                    raise BatchError(
                        f"tensor column {key!r} is a {type(value).__name__}; non-tensors go in `non_tensors`"
                    )
                if value.dim() == 0:
                    raise BatchError(f"tensor column {key!r} is a 0-d tensor; it needs one entry per row")
            sizes = {key: value.shape[0] for key, value in tensor_map.items()}
            sizes.update({key: len(col) for key, col in non_tensor_columns.items()})
            if len(set(sizes.values())) > 1:
                raise BatchError(f"columns have different numbers of rows: {sizes}")
            num_rows = next(iter(sizes.values()), 0)
            tensor_dict = TensorDict(tensor_map, batch_size=[num_rows])
        num_rows = int(tensor_dict.batch_size[0])
        wrong = {key: len(col) for key, col in non_tensor_columns.items() if len(col) != num_rows}
        if wrong:
            raise BatchError(f"non-tensor columns {wrong} do not have the batch's {num_rows} rows")
        overlap = set(tensor_dict.keys()) & set(non_tensor_columns)
        if overlap:
            raise BatchError(f"keys {sorted(overlap)} are both tensor and non-tensor columns")
        self._tensors = tensor_dict
        self._non_tensors = non_tensor_columns
        self._meta = dict(meta or {})

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        *,
        meta_info: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Build from plain dicts (``meta_info`` is the DataProto spelling of ``meta``)."""
        if meta is not None and meta_info is not None:
            raise BatchError("pass meta or meta_info, not both")
        return cls(tensors=tensors, non_tensors=non_tensors, meta=meta if meta is not None else meta_info)

    def _derive(self, tensors: TensorDict, non_tensors: dict[str, np.ndarray], meta: dict | None = None) -> Batch:
        out = Batch.__new__(Batch)
        out._tensors = tensors
        out._non_tensors = non_tensors
        out._meta = dict(self._meta) if meta is None else meta
        return out

    # ------------------------------------------------------------------ accessors
    @property
    def tensors(self) -> TensorDict:
        """Tensor columns, a TensorDict with ``batch_size == [len(self)]``."""
        return self._tensors

    @property
    def non_tensors(self) -> dict[str, np.ndarray]:
        """Non-tensor columns, numpy arrays of ``len(self)`` rows."""
        return self._non_tensors

    @property
    def meta(self) -> dict[str, Any]:
        """Batch-level values that are not indexed by row."""
        return self._meta

    # DataProto aliases
    batch = tensors
    non_tensor_batch = non_tensors
    meta_info = meta

    @property
    def tensor_keys(self) -> list[str]:
        return list(self._tensors.keys())

    @property
    def non_tensor_keys(self) -> list[str]:
        return list(self._non_tensors.keys())

    def __len__(self) -> int:
        return int(self._tensors.batch_size[0])

    def __contains__(self, key: object) -> bool:
        return key in self._tensors.keys() or key in self._non_tensors

    def __repr__(self) -> str:
        tensors = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in self._tensors.items()}
        return (
            f"Batch(len={len(self)}, tensors={tensors}, non_tensors={self.non_tensor_keys}, meta={sorted(self._meta)})"
        )

    def __getitem__(self, item: Any) -> Any:
        """``batch["key"]`` -> the column; ``batch[a:b]`` / ``batch[indices]`` / ``batch[mask]`` -> Batch."""
        if isinstance(item, str):
            if item in self._non_tensors:
                return self._non_tensors[item]
            if item in self._tensors.keys():
                return self._tensors[item]
            raise UnknownKeyError(
                f"unknown column {item!r}; tensor columns: {self.tensor_keys}, "
                f"non-tensor columns: {self.non_tensor_keys}"
            )
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (int, np.integer)):
            raise TypeError(f"Batch[{item}] is ambiguous; use batch[{item}:{item}+1] for a one-row Batch")
        return self.index_select(item)

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace a column; a torch.Tensor becomes a tensor column, anything else non-tensor."""
        if not isinstance(key, str):
            raise TypeError(f"column names are strings, got {type(key).__name__}")
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != len(self):
                raise BatchError(f"tensor column {key!r} has shape {tuple(value.shape)}; it needs {len(self)} rows")
            self._non_tensors.pop(key, None)
            self._tensors.set(key, value)
        else:
            column = _as_column(key, value)
            if len(column) != len(self):
                raise BatchError(f"non-tensor column {key!r} has {len(column)} rows; the batch has {len(self)}")
            if key in self._tensors.keys():
                del self._tensors[key]
            self._non_tensors[key] = column

    # ------------------------------------------------------------------ column operations
    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        *,
        deepcopy: bool = False,
    ) -> Batch:
        """A Batch with only the named columns / meta keys (``None`` keeps all of that kind)."""
        tensor_keys = _check_keys("tensor", batch_keys, self.tensor_keys)
        non_tensor_keys = _check_keys("non-tensor", non_tensor_batch_keys, self.non_tensor_keys)
        meta_keys = _check_keys("meta", meta_info_keys, self._meta)
        tensors = self._tensors.select(*tensor_keys) if tensor_keys is not None else self._tensors.copy()
        non_tensors = {
            k: self._non_tensors[k] for k in (non_tensor_keys if non_tensor_keys is not None else self._non_tensors)
        }
        meta = {k: self._meta[k] for k in (meta_keys if meta_keys is not None else self._meta)}
        if deepcopy:
            tensors = tensors.clone()
            non_tensors = copy.deepcopy(non_tensors)
            meta = copy.deepcopy(meta)
        return self._derive(tensors, non_tensors, meta)

    def pop(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_batch_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
    ) -> Batch:
        """Remove the named columns / meta keys from this Batch and return them as a new Batch."""
        tensor_keys = _check_keys("tensor", batch_keys, self.tensor_keys) or []
        non_tensor_keys = _check_keys("non-tensor", non_tensor_batch_keys, self.non_tensor_keys) or []
        meta_keys = _check_keys("meta", meta_info_keys, self._meta) or []
        tensors = TensorDict({k: self._tensors.pop(k) for k in tensor_keys}, batch_size=self._tensors.batch_size)
        non_tensors = {k: self._non_tensors.pop(k) for k in non_tensor_keys}
        meta = {k: self._meta.pop(k) for k in meta_keys}
        return self._derive(tensors, non_tensors, meta)

    def union(self, other: Batch) -> Batch:
        """Add ``other``'s columns and meta in place (DataProto semantics; shared keys must be equal); returns self."""
        if len(self) != len(other):
            raise BatchError(f"cannot union batches of {len(self)} and {len(other)} rows")
        for key, value in other._tensors.items():
            if key in self._non_tensors:
                raise BatchError(f"key {key!r} is a non-tensor column here and a tensor column in other")
            if key in self._tensors.keys() and not _values_equal(self._tensors[key], value):
                raise BatchError(f"tensor column {key!r} differs between the two batches")
        for key, value in other._non_tensors.items():
            if key in self._tensors.keys():
                raise BatchError(f"key {key!r} is a tensor column here and a non-tensor column in other")
            if key in self._non_tensors and not _values_equal(self._non_tensors[key], value):
                raise BatchError(f"non-tensor column {key!r} differs between the two batches")
        for key, value in other._meta.items():
            if key in self._meta and not _values_equal(self._meta[key], value):
                raise BatchError(f"meta key {key!r} differs between the two batches: {self._meta[key]!r} vs {value!r}")
        for key, value in other._tensors.items():
            if key not in self._tensors.keys():
                self._tensors.set(key, value)
        for key, value in other._non_tensors.items():
            self._non_tensors.setdefault(key, value)
        for key, value in other._meta.items():
            self._meta.setdefault(key, value)
        return self

    # ------------------------------------------------------------------ row operations
    def index_select(self, indices: Any) -> Batch:
        """Rows at ``indices`` (int array/list/tensor, repeats allowed) or a boolean mask of length B."""
        index = np.asarray(indices.detach().cpu() if isinstance(indices, torch.Tensor) else indices)
        if index.ndim != 1:
            raise BatchError(f"row indices must be 1-d, got shape {index.shape}")
        if index.dtype == bool:
            if len(index) != len(self):
                raise BatchError(f"boolean mask has {len(index)} entries; the batch has {len(self)} rows")
            index = np.flatnonzero(index)
        elif index.size == 0:
            index = index.astype(np.int64)
        elif not np.issubdtype(index.dtype, np.integer):
            raise BatchError(f"row indices must be integers or a boolean mask, got dtype {index.dtype}")
        index = index.astype(np.int64, copy=False)
        bad = index[(index < -len(self)) | (index >= len(self))]
        if bad.size:
            raise BatchError(f"row indices {bad[:8].tolist()} are out of range for a batch of {len(self)} rows")
        index_tensor = torch.from_numpy(index)
        tensors = TensorDict(
            {k: v[index_tensor.to(v.device)] for k, v in self._tensors.items()},
            batch_size=[len(index)],
            device=self._tensors.device,
        )
        return self._derive(tensors, {k: v[index] for k, v in self._non_tensors.items()})

    select_idxs = index_select

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> Batch:
        """Rows ``start:end:step`` (views of the tensors, as with torch slicing)."""
        rows = slice(start, end, step)
        num_rows = len(range(*rows.indices(len(self))))
        tensors = TensorDict(
            {k: v[rows] for k, v in self._tensors.items()}, batch_size=[num_rows], device=self._tensors.device
        )
        return self._derive(tensors, {k: v[rows] for k, v in self._non_tensors.items()})

    def reorder(self, indices: Any) -> Batch:
        """Permute the rows in place so that new row i is old row ``indices[i]``; returns self."""
        index = np.asarray(indices.detach().cpu() if isinstance(indices, torch.Tensor) else indices)
        if index.shape != (len(self),) or not np.array_equal(np.sort(index), np.arange(len(self))):
            raise BatchError(f"reorder needs a permutation of range({len(self)}), got {index.tolist()[:16]}")
        permuted = self.index_select(index)
        self._tensors, self._non_tensors = permuted._tensors, permuted._non_tensors
        return self

    def split(self, split_size: int | Sequence[int]) -> list[Batch]:
        """Consecutive pieces of ``split_size`` rows (last may be shorter), or of the given sizes (summing to B)."""
        if isinstance(split_size, (int, np.integer)):
            if split_size <= 0:
                raise BatchError(f"split_size must be positive, got {split_size}")
            sizes = [min(int(split_size), len(self) - s) for s in range(0, len(self), int(split_size))]
        else:
            sizes = [int(s) for s in split_size]
            if any(s < 0 for s in sizes) or sum(sizes) != len(self):
                raise BatchError(f"split sizes {sizes} must be non-negative and sum to the batch's {len(self)} rows")
        bounds = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        return [self.slice(int(bounds[i]), int(bounds[i + 1])) for i in range(len(sizes))]

    def chunk(self, chunks: int) -> list[Batch]:
        """``chunks`` consecutive pieces differing by at most one row, larger first (DataProto.chunk when even)."""
        if chunks <= 0:
            raise BatchError(f"chunks must be positive, got {chunks}")
        base, extra = divmod(len(self), chunks)
        return self.split([base + 1 if i < extra else base for i in range(chunks)])

    def repeat(self, repeat_times: int = 2, *, interleave: bool = True) -> Batch:
        """Each row ``repeat_times`` times: ``interleave`` gives a,a,b,b; otherwise a,b,a,b."""
        if repeat_times < 1:
            raise BatchError(f"repeat_times must be >= 1, got {repeat_times}")
        rows = np.arange(len(self))
        index = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self.index_select(index)

    def to(self, device: torch.device | str) -> Batch:
        """Move the tensors to ``device`` in place (DataProto semantics); returns self."""
        self._tensors = self._tensors.to(device)
        return self

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all ``batches`` in order; columns and shared meta keys must match (``"metrics"`` is
        gathered into lists, ``micro_batch_sizes`` dropped)."""
        batches = list(batches)
        if not batches:
            raise BatchError("cannot concat an empty list of batches")
        for i, b in enumerate(batches):
            if not isinstance(b, Batch):
                raise BatchError(f"concat item {i} is a {type(b).__name__}, not a Batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            if set(b.tensor_keys) != set(first.tensor_keys) or set(b.non_tensor_keys) != set(first.non_tensor_keys):
                raise BatchError(
                    f"batch {i} has columns tensors={sorted(b.tensor_keys)} non_tensors={sorted(b.non_tensor_keys)}; "
                    f"batch 0 has tensors={sorted(first.tensor_keys)} non_tensors={sorted(first.non_tensor_keys)}"
                )
        tensors = {}
        for key in first.tensor_keys:
            parts = [b._tensors[key] for b in batches]
            if len({p.shape[1:] for p in parts}) > 1 or len({p.dtype for p in parts}) > 1:
                shapes = [(tuple(p.shape), str(p.dtype)) for p in parts]
                raise BatchError(f"tensor column {key!r} has incompatible shapes/dtypes across batches: {shapes}")
            tensors[key] = torch.cat(parts, dim=0)
        num_rows = sum(len(b) for b in batches)
        non_tensors = {
            key: np.concatenate([b._non_tensors[key] for b in batches], axis=0) for key in first.non_tensor_keys
        }
        meta: dict[str, Any] = {}
        metrics: list = []
        for b in batches:
            for key, value in b._meta.items():
                if key == MICRO_BATCH_SIZES_KEY:
                    continue
                if key == "metrics":
                    if value is not None:
                        metrics.extend(value if isinstance(value, list) else [value])
                elif key in meta and not _values_equal(meta[key], value):
                    raise BatchError(
                        f"meta key {key!r} differs across concatenated batches: {meta[key]!r} vs {value!r}"
                    )
                else:
                    meta.setdefault(key, value)
        if metrics:
            meta["metrics"] = {
                k: [m[k] for m in metrics if k in m] for k in dict.fromkeys(k for m in metrics for k in m)
            }
        tensor_dict = TensorDict(tensors, batch_size=[num_rows], device=first._tensors.device)
        return first._derive(tensor_dict, non_tensors, meta)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> tuple:
        # Plain tensors pickle through torch's reducers (Ray ships them out of band); moving them to
        # the CPU first lets a GPU worker return results to a driver without a GPU.
        tensors = {k: v.detach().cpu() for k, v in self._tensors.items()}
        return tensors, len(self), self._non_tensors, self._meta

    def __setstate__(self, state: tuple) -> None:
        tensors, num_rows, non_tensors, meta = state
        self._tensors = TensorDict(tensors, batch_size=[num_rows])
        self._non_tensors = non_tensors
        self._meta = meta
