"""``utils/process_state.py``: a process that leaves its group and joins another as a different rank
sees its own rank's mesh coordinate, as a fresh process would (the warm pools rely on it).

The reference is the rank the process joins as; the negative control leaves its group with
``dist.destroy_process_group`` alone and must see the earlier rank's coordinate (DTensor's
sharding-propagation cache hands back the earlier group's equal-comparing mesh).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from verl_balance.distributed.launcher import new_rendezvous
from verl_balance.utils.process_state import destroy_process_groups

pytestmark = pytest.mark.slow  # two spawned processes

WORLD = 2


def _doubled_shard_coordinate(rank: int, init_method: str) -> dict:
    """Join a gloo group as ``rank``; the mesh coordinate and local shard of a DTensor op's output."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    doubled = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]) * 2
    dist.barrier()
    return {"coordinate": doubled.device_mesh.get_coordinate(), "local": doubled.to_local().tolist()}


def _two_jobs(slot: int, rendezvous: list[str], reset: bool, out_dir: str) -> None:
    first = _doubled_shard_coordinate(slot, rendezvous[0])
    if reset:
        assert destroy_process_groups()
    else:
        dist.destroy_process_group()
    second = _doubled_shard_coordinate(WORLD - 1 - slot, rendezvous[1])  # the ranks swap
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{slot}.json"), "w") as f:
        json.dump({"first": first, "second": second}, f)


def _run(tmp_path, *, reset: bool) -> dict[int, dict]:
    rendezvous = [new_rendezvous(), new_rendezvous()]
    mp.spawn(_two_jobs, args=(rendezvous, reset, str(tmp_path)), nprocs=WORLD, join=True)
    return {slot: json.loads((tmp_path / f"{slot}.json").read_text()) for slot in range(WORLD)}


def test_a_process_that_rejoins_as_another_rank_sees_its_own_mesh_coordinate(tmp_path):
    (tmp_path / "reset").mkdir()
    (tmp_path / "plain").mkdir()
    reset = _run(tmp_path / "reset", reset=True)
    for slot, jobs in reset.items():
        assert jobs["first"]["coordinate"] == [slot]
        assert jobs["second"]["coordinate"] == [WORLD - 1 - slot]
        assert jobs["second"]["local"] == (torch.arange(8.0) * 2).chunk(WORLD)[WORLD - 1 - slot].tolist()
    # negative control: without the cache reset, each process keeps the coordinate of its first rank
    plain = _run(tmp_path / "plain", reset=False)
    for slot, jobs in plain.items():
        assert jobs["second"]["coordinate"] == [slot] != [WORLD - 1 - slot]
