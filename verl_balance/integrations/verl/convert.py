"""Conversions between verl's data containers and our ``Batch``.

- ``batch_from_dataproto`` / ``batch_to_dataproto``: ``DataProto`` <-> ``Batch`` sharing tensors;
- ``batch_from_tensordict``: verl 0.9's TensorDict (no-padding layout) -> right-padded ``Batch``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from verl_balance.batch_keys import ATTENTION_MASK_KEY, INPUT_IDS_KEY
from verl_balance.integrations.verl.errors import require_verl

__all__ = ["batch_from_dataproto", "batch_from_tensordict", "batch_to_dataproto"]


def batch_from_dataproto(data) -> Any:
    """``DataProto`` -> ``Batch`` sharing the tensors; non-tensor columns and meta_info carried over.

    A DataProto without tensors (``batch=None``) becomes a Batch with an empty TensorDict of the
    same length; ``batch_to_dataproto`` maps it back to ``batch=None``."""
    from tensordict import TensorDict

    from verl_balance.protocol import Batch

    tensors = data.batch if data.batch is not None else TensorDict({}, batch_size=[len(data)])
    return Batch(tensors=tensors, non_tensors=dict(data.non_tensor_batch or {}), meta=dict(data.meta_info or {}))


def batch_to_dataproto(batch) -> Any:
    """``Batch`` -> ``DataProto`` (a Batch without tensor columns gets ``batch=None``, as verl does)."""
    require_verl()
    from verl import DataProto

    tensors = batch.tensors if len(batch.tensor_keys) else None
    return DataProto(batch=tensors, non_tensor_batch=dict(batch.non_tensors), meta_info=dict(batch.meta))


def batch_from_tensordict(data) -> Any:
    """A verl 0.9 TensorDict (its ``DataProto.to_tensordict`` / no-padding layout) -> ``Batch``.

    Dense tensors stay columns, ``NonTensorStack`` entries become non-tensor columns and
    ``NonTensorData`` entries become meta. Jagged (nested) tensors are right-padded with 0, and an
    ``attention_mask`` is built from the nested ``input_ids`` lengths when absent."""
    from tensordict import NonTensorData, NonTensorStack

    from verl_balance.protocol import Batch

    tensors, non_tensors, meta = {}, {}, {}
    lengths = None
    for key in list(data.keys()):
        value = data.get(key)
        if isinstance(value, NonTensorStack):
            column = np.empty(len(value), dtype=object)
            for i, item in enumerate(value):
                column[i] = item.data if isinstance(item, NonTensorData) else item
            non_tensors[key] = column
        elif isinstance(value, NonTensorData):
            meta[key] = value.data
        elif isinstance(value, torch.Tensor) and value.is_nested:
            if key == INPUT_IDS_KEY:
                lengths = value.offsets().diff()
            tensors[key] = torch.nested.to_padded_tensor(value, 0)
        elif isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            meta[key] = value
    if lengths is not None and ATTENTION_MASK_KEY not in tensors:
        width = tensors[INPUT_IDS_KEY].shape[1]
        tensors[ATTENTION_MASK_KEY] = (torch.arange(width)[None, :] < lengths[:, None].cpu()).long()
    return Batch(tensors=tensors, non_tensors=non_tensors, meta=meta)
