"""Parallel layout (DeviceMesh with axes "dp", "sp") and Ulysses sequence-parallel primitives."""

from verl_balance.distributed.layout import (
    LayoutError,
    ParallelLayout,
    default_device_type,
    init_distributed,
)
from verl_balance.distributed.ulysses import (
    all_to_all_head_to_seq,
    all_to_all_seq_to_head,
    all_to_all_seq_to_head_together,
    gather_and_unpad,
    pad_and_slice,
    pad_to_multiple,
    padded_length,
    slice_for_rank,
)

__all__ = [
    "LayoutError",
    "ParallelLayout",
    "all_to_all_head_to_seq",
    "all_to_all_seq_to_head",
    "all_to_all_seq_to_head_together",
    "default_device_type",
    "gather_and_unpad",
    "init_distributed",
    "pad_and_slice",
    "pad_to_multiple",
    "padded_length",
    "slice_for_rank",
]
