"""Weight-sync buckets: consecutive tensors of a state dict grouped up to a byte budget, and the
unsharded tensors of an FSDP2 model streamed bucket by bucket.

Invariant: every rank of the mesh computes the same plan (global shapes and dtypes in ``state_dict``
order) and gathers the same tensors in the same order, so the all-gathers (``DTensor.full_tensor``)
line up; no rank holds more than one bucket of unsharded tensors at a time beyond what its consumer
keeps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

DEFAULT_BUCKET_BYTES = 256 << 20
"""Unsharded bytes per sync bucket (verl's ``update_weights_bucket_megabytes`` is 2048 on GPUs;
on CPU workers a smaller bucket bounds the driver's copy)."""


def plan_buckets(sizes: list[tuple[str, int]], *, bucket_bytes: int) -> list[list[str]]:
    """Consecutive tensor names grouped into buckets of at most ``bucket_bytes`` (a larger tensor
    alone); every name in exactly one bucket, in the given order."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    buckets: list[list[str]] = []
    filled = bucket_bytes  # forces a new bucket for the first tensor
    for name, nbytes in sizes:
        if filled + nbytes > bucket_bytes or not buckets:
            buckets.append([])
            filled = 0
        buckets[-1].append(name)
        filled += nbytes
    return buckets


def tensor_bytes(value: torch.Tensor) -> int:
    """Unsharded bytes of a (possibly DTensor) parameter."""
    return value.numel() * value.element_size()  # DTensor.numel() is the global count


def stream_full_tensors(
    state: dict[str, torch.Tensor], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: torch.device | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, unsharded tensor)`` of every entry of ``state``, gathered one bucket at a time (collective
    for DTensors: every rank must consume the whole iterator). A bucket's tensors are released once the
    consumer moved past them."""
    buckets = plan_buckets([(name, tensor_bytes(v)) for name, v in state.items()], bucket_bytes=bucket_bytes)
    for names in buckets:
        gathered = []
        for name in names:
            value = state[name]
            full = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
            gathered.append((name, full if device is None else full.to(device)))
        while gathered:
            yield gathered.pop(0)


__all__ = ["DEFAULT_BUCKET_BYTES", "plan_buckets", "stream_full_tensors", "tensor_bytes"]
