"""Ulysses primitives vs plain tensor ops, forward and backward, on 4 gloo ranks.

Each rank builds the same full tensors from a seed; the distributed result on each rank is
compared with the slice plain indexing predicts. Groups of size 2 (the "sp" axis of a 2 x 2
mesh) and 4 (the world) are both exercised in one spawn.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from verl_balance.distributed import (
    all_to_all_head_to_seq,
    all_to_all_seq_to_head,
    all_to_all_seq_to_head_together,
    gather_and_unpad,
    pad_and_slice,
    pad_to_multiple,
    padded_length,
    slice_for_rank,
)
from verl_balance.distributed.launcher import run_on_ranks

pytestmark = pytest.mark.slow  # spawns a process group


def _check_group(group, tag):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(7)
    seq, heads, dim = 4 * world, 2 * world, 3
    x_full = torch.randn(seq, heads, dim, generator=gen)
    g_full = torch.randn(seq, heads, dim, generator=gen)
    rows = slice(rank * seq // world, (rank + 1) * seq // world)
    cols = slice(rank * heads // world, (rank + 1) * heads // world)
    errors = {}

    # seq -> head: this rank gets every token of its head block.
    x_local = x_full[rows].clone().requires_grad_(True)
    y = all_to_all_seq_to_head(x_local, group=group)
    errors[f"{tag} seq_to_head fwd"] = float((y - x_full[:, cols]).abs().max())
    (y * g_full[:, cols]).sum().backward()
    # Summed over ranks, the loss is sum(x_full * g_full): d/dx_local = g_full[rows].
    errors[f"{tag} seq_to_head bwd"] = float((x_local.grad - g_full[rows]).abs().max())

    # head -> seq is the inverse.
    h_local = x_full[:, cols].clone().requires_grad_(True)
    z = all_to_all_head_to_seq(h_local, group=group)
    errors[f"{tag} head_to_seq fwd"] = float((z - x_full[rows]).abs().max())
    (z * g_full[rows]).sum().backward()
    errors[f"{tag} head_to_seq bwd"] = float((h_local.grad - g_full[:, cols]).abs().max())

    # pad + slice, then gather + unpad restores the original; backward gives the own slice.
    length = 4 * world + 1
    packed = torch.randn(length, 5, generator=gen)
    grad_out = torch.randn(length, 5, generator=gen)
    local = pad_and_slice(packed, rank=rank, world=world).clone().requires_grad_(True)
    gathered = gather_and_unpad(local, group=group, length=length)
    errors[f"{tag} gather fwd"] = float((gathered - packed).abs().max())
    (gathered * grad_out).sum().backward()
    expected = pad_and_slice(grad_out, rank=rank, world=world)
    errors[f"{tag} gather bwd"] = float((local.grad - expected).abs().max())
    errors.update(_check_together(group, tag, gen))
    return errors


def _check_together(group, tag, gen):
    """q, k, v of different head counts and widths in one all-to-all: each equals plain indexing,
    forward and backward, and the forward and the backward issue one collective each."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seq = 2 * world
    shapes = {"q": (seq, 2 * world, 3), "k": (seq, world, 3), "v": (seq, world, 5)}
    full = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    grads = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    rows = slice(rank * seq // world, (rank + 1) * seq // world)
    local = {name: x[rows].clone().requires_grad_(True) for name, x in full.items()}
    cols = {name: slice(rank * shape[1] // world, (rank + 1) * shape[1] // world) for name, shape in shapes.items()}
    calls = []
    all_to_all_single = dist.all_to_all_single
    dist.all_to_all_single = lambda *args, **kwargs: calls.append(1) or all_to_all_single(*args, **kwargs)
    try:
        outs = dict(zip(shapes, all_to_all_seq_to_head_together(*local.values(), group=group)))
        forward_calls = len(calls)
        sum((outs[name] * grads[name][:, cols[name]]).sum() for name in shapes).backward()
    finally:
        dist.all_to_all_single = all_to_all_single
    errors = {f"{tag} together collectives": float(abs(forward_calls - 1) + abs(len(calls) - 2))}
    for name in shapes:
        expected = full[name][:, cols[name]]
        assert outs[name].shape == expected.shape, (name, outs[name].shape, expected.shape)
        errors[f"{tag} together {name} fwd"] = float((outs[name] - expected).abs().max())
        errors[f"{tag} together {name} bwd"] = float((local[name].grad - grads[name][rows]).abs().max())
    return errors


def _ulysses_checks(rank):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    errors = _check_group(mesh.get_group("sp"), "sp=2")
    errors.update(_check_group(dist.group.WORLD, "sp=4"))
    return errors


@pytest.fixture(scope="module")
def ulysses_errors():
    return run_on_ranks(_ulysses_checks, world=4)


def test_all_to_all_and_gather_match_plain_indexing_forward_and_backward(ulysses_errors):
    for rank, errors in enumerate(ulysses_errors):
        assert len(errors) == 26
        for name, err in errors.items():
            assert err == 0.0, f"rank {rank}: {name} off by {err}"


def test_pad_and_slice_partition_the_padded_sequence():
    x = torch.arange(10)
    for world in (1, 2, 3, 4):
        parts = [pad_and_slice(x, rank=r, world=world, value=-1) for r in range(world)]
        joined = torch.cat(parts)
        assert len(joined) == padded_length(10, multiple=world) and len(joined) % world == 0
        assert joined[:10].tolist() == x.tolist() and (joined[10:] == -1).all()
    assert padded_length(0, multiple=4) == 4  # an empty stream still gives each rank a token
    assert pad_to_multiple(torch.zeros(0), multiple=2).shape == (2,)
    assert slice_for_rank(torch.arange(6), rank=2, world=3).tolist() == [4, 5]
