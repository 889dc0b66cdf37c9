"""Ulysses sequence-parallel primitives (DeepSpeed-Ulysses style) as autograd functions.

Invariants:
- A packed micro-batch of T tokens is padded to T_pad = ceil(T / sp) * sp and SP rank r holds
  the contiguous slice [r * T_pad / sp, (r + 1) * T_pad / sp); every per-token tensor is sliced the
  same way. cu_seqlens refer to the padded, unsliced stream and are identical on every SP rank.
- all_to_all_seq_to_head ([T_pad / sp, heads, d] -> [T_pad, heads / sp, d]) and
  all_to_all_head_to_seq are inverses, and each one's backward is the other.
- gather_and_unpad assumes its output feeds a computation replicated on every SP rank, so its
  backward hands each rank the gradient of its own slice (no sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _all_to_all(
    xs: tuple[Tensor, ...], *, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
) -> tuple[Tensor, ...]:
    """One all-to-all for all of ``xs``: block j of each to rank j, received blocks joined along gather_dim."""
    world = dist.get_world_size(group)
    if world == 1:
        return xs
    # Each tensor as [world, block]: row j is its block for rank j, flattened so tensors of different
    # shapes share one send buffer; row j of the buffer is everything rank j receives from this rank.
    blocks = [torch.stack(x.chunk(world, dim=scatter_dim), dim=0) for x in xs]
    send = torch.cat([b.reshape(world, -1) for b in blocks], dim=1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    parts = recv.split([b[0].numel() for b in blocks], dim=1)
    # recv[j] is rank j's sequence block of this rank's head block, for each tensor in turn.
    return tuple(
        torch.cat(part.reshape(b.shape).unbind(0), dim=gather_dim).contiguous() for part, b in zip(parts, blocks)
    )


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, scatter_dim, gather_dim, *xs):
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(xs, group=group, scatter_dim=scatter_dim, gather_dim=gather_dim)

    @staticmethod
    def backward(ctx, *grads):
        inverse = _all_to_all(grads, group=ctx.group, scatter_dim=ctx.gather_dim, gather_dim=ctx.scatter_dim)
        return (None, None, None, *inverse)


def all_to_all_seq_to_head(x: Tensor, *, group: dist.ProcessGroup, seq_dim: int = 0, head_dim: int = 1) -> Tensor:
    """[T/sp, H, d] sequence-sharded -> [T, H/sp, d] head-sharded (differentiable)."""
    return _SeqAllToAll.apply(group, head_dim, seq_dim, x)[0]


def all_to_all_seq_to_head_together(
    *xs: Tensor, group: dist.ProcessGroup, seq_dim: int = 0, head_dim: int = 1
) -> tuple[Tensor, ...]:
    """``all_to_all_seq_to_head`` of q, k, v in one collective (and one in the backward)."""
    return _SeqAllToAll.apply(group, head_dim, seq_dim, *xs)


def all_to_all_head_to_seq(x: Tensor, *, group: dist.ProcessGroup, seq_dim: int = 0, head_dim: int = 1) -> Tensor:
    """[T, H/sp, d] head-sharded -> [T/sp, H, d] sequence-sharded (differentiable)."""
    return _SeqAllToAll.apply(group, seq_dim, head_dim, x)[0]


def padded_length(length: int, *, multiple: int) -> int:
    """Smallest multiple of `multiple` >= length, at least `multiple` (every SP rank runs a forward)."""
    return max(multiple, -(-length // multiple) * multiple)


def pad_to_multiple(x: Tensor, *, multiple: int, dim: int = 0, value: float = 0) -> Tensor:
    """Right-pad x along dim to padded_length(x.shape[dim], multiple=multiple) with `value`."""
    pad = padded_length(x.shape[dim], multiple=multiple) - x.shape[dim]
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def slice_for_rank(x: Tensor, *, rank: int, world: int, dim: int = 0) -> Tensor:
    """The rank-th of `world` equal contiguous slices of x along dim (length must divide)."""
    length = x.shape[dim]
    assert length % world == 0, f"length {length} is not a multiple of {world}; pad first"
    return x.narrow(dim, rank * (length // world), length // world)


def pad_and_slice(x: Tensor, *, rank: int, world: int, dim: int = 0, value: float = 0) -> Tensor:
    """Pad a packed sequence to a multiple of world and return this rank's slice."""
    return slice_for_rank(pad_to_multiple(x, multiple=world, dim=dim, value=value), rank=rank, world=world, dim=dim)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        world = dist.get_world_size(group)
        if world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        world = dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return slice_for_rank(grad, rank=rank, world=world, dim=ctx.dim).contiguous(), None, None


def gather_and_unpad(x: Tensor, *, group: dist.ProcessGroup, length: int, dim: int = 0) -> Tensor:
    """All-gather SP slices along dim and drop the padding beyond `length` (differentiable)."""
    return _GatherSeq.apply(x, group, dim).narrow(dim, 0, length)
