"""Dispatch / collect rules in isolation (no Ray): who receives which rows, whose output returns."""

from __future__ import annotations

import pytest
import torch

from verl_balance.protocol import Batch
from verl_balance.single_controller import (
    Dispatch,
    DispatchError,
    Execute,
    MeshInfo,
    MeshLayout,
    MeshLayoutError,
    make_mesh_dispatch,
    register,
)
from verl_balance.single_controller.decorator import collect_outputs, dispatch_args, get_registration


def rows(n: int) -> Batch:
    return Batch.from_dict(tensors={"x": torch.arange(n)}, non_tensors={"uid": [f"u{i}" for i in range(n)]})


def dp2_sp2_layout() -> MeshLayout:
    # worker rank = dp_rank * sp + sp_rank; SP rank 0 collects
    infos = [MeshInfo(dp_rank=r // 2, dp_size=2, is_collect=r % 2 == 0) for r in range(4)]
    return MeshLayout.from_worker_infos("actor", infos)


def test_register_records_modes_without_changing_the_method():
    class W:
        @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.RANK_ZERO, blocking=False)
        def f(self, x):
            return x + 1

    reg = get_registration(W.f)
    assert (reg.dispatch_mode, reg.execute_mode, reg.blocking) == (Dispatch.DP_COMPUTE_PROTO, Execute.RANK_ZERO, False)
    assert W().f(1) == 2
    with pytest.raises(DispatchError, match="dispatch_mode"):
        register(dispatch_mode="dp")


def test_one_to_all_gives_every_rank_the_same_arguments():
    calls = dispatch_args(Dispatch.ONE_TO_ALL, (1,), {"k": "v"}, world_size=3)
    assert calls == [((1,), {"k": "v"})] * 3


def test_all_to_all_gives_rank_i_item_i_and_checks_lengths():
    calls = dispatch_args(Dispatch.ALL_TO_ALL, ([10, 11, 12],), {"k": ["a", "b", "c"]}, world_size=3)
    assert calls == [((10,), {"k": "a"}), ((11,), {"k": "b"}), ((12,), {"k": "c"})]
    with pytest.raises(DispatchError, match="list of 3 .* length 2"):
        dispatch_args(Dispatch.ALL_TO_ALL, ([1, 2],), {}, world_size=3)


def test_dp_compute_proto_chunks_batches_and_broadcasts_the_rest():
    calls = dispatch_args(Dispatch.DP_COMPUTE_PROTO, (rows(6), 0.5), {}, world_size=3)
    assert [c[0][0]["x"].tolist() for c in calls] == [[0, 1], [2, 3], [4, 5]]
    assert [c[0][1] for c in calls] == [0.5] * 3
    outputs = [c[0][0] for c in calls]
    assert collect_outputs(Dispatch.DP_COMPUTE_PROTO, outputs)["uid"].tolist() == [f"u{i}" for i in range(6)]
    assert collect_outputs(Dispatch.DP_COMPUTE_PROTO, [{"m": 1}, {"m": 2}]) == [{"m": 1}, {"m": 2}]


def test_mesh_dispatch_replicates_each_dp_chunk_over_its_sp_ranks():
    mesh = dp2_sp2_layout()
    calls = dispatch_args(make_mesh_dispatch("actor"), (rows(6),), {"scale": 2}, world_size=4, mesh=mesh)
    got = [c[0][0]["x"].tolist() for c in calls]
    assert got == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert calls[0][0][0] is calls[1][0][0]  # one object per DP chunk (shipped once)
    assert all(c[1] == {"scale": 2} for c in calls)


def test_mesh_dispatch_accepts_a_list_of_per_dp_batches():
    mesh = dp2_sp2_layout()
    per_dp = [rows(1), rows(3)]
    calls = dispatch_args(make_mesh_dispatch("actor"), (per_dp,), {}, world_size=4, mesh=mesh)
    assert [len(c[0][0]) for c in calls] == [1, 1, 3, 3]
    with pytest.raises(DispatchError, match="list of 3 Batches; the mesh has dp_size=2"):
        dispatch_args(make_mesh_dispatch("actor"), ([rows(1)] * 3,), {}, world_size=4, mesh=mesh)


def test_mesh_collect_returns_only_collect_ranks_in_dp_order():
    mesh = dp2_sp2_layout()
    outputs = [Batch.from_dict(tensors={"r": torch.tensor([r])}) for r in range(4)]
    assert collect_outputs(make_mesh_dispatch("actor"), outputs, mesh=mesh)["r"].tolist() == [0, 2]
    assert collect_outputs(make_mesh_dispatch("actor"), ["a", "b", "c", "d"], mesh=mesh) == ["a", "c"]


def test_mesh_layout_rejects_missing_or_inconsistent_registration():
    ok = [MeshInfo(dp_rank=r // 2, dp_size=2, is_collect=r % 2 == 0) for r in range(4)]
    with pytest.raises(MeshLayoutError, match=r"worker rank\(s\) \[3\] did not register"):
        MeshLayout.from_worker_infos("actor", ok[:3] + [None])
    two_collectors = ok[:1] + [MeshInfo(dp_rank=0, dp_size=2, is_collect=True)] + ok[2:]
    with pytest.raises(MeshLayoutError, match="exactly one is_collect"):
        MeshLayout.from_worker_infos("actor", two_collectors)
    with pytest.raises(MeshLayoutError, match=r"no worker registered dp_rank\(s\) \[1\]"):
        MeshLayout.from_worker_infos("actor", [MeshInfo(dp_rank=0, dp_size=2, is_collect=r == 0) for r in range(2)])
    with pytest.raises(MeshLayoutError, match="different or invalid dp_size"):
        MeshLayout.from_worker_infos("actor", [MeshInfo(0, 1, True), MeshInfo(0, 2, False)])


class _RecordingRemote:
    def __init__(self, sent: list):
        self.sent = sent

    def remote(self, *args, **kwargs):
        self.sent.append((args, kwargs))
        return len(self.sent)


class _RecordingWorker:
    def __init__(self):
        self.sent = []
        self.update = _RecordingRemote(self.sent)


def test_a_batch_shared_by_workers_is_stored_once_and_a_single_workers_batch_goes_inline(monkeypatch):
    from verl_balance.single_controller import worker_group
    from verl_balance.single_controller.worker_group import RayWorkerGroup

    puts = []  # no cluster: the object store's put is recorded instead
    monkeypatch.setattr(worker_group.ray, "put", lambda value: puts.append(value) or f"ref{len(puts)}")
    group = RayWorkerGroup.__new__(RayWorkerGroup)
    group._workers = [_RecordingWorker() for _ in range(3)]
    shared = Batch.from_dict(tensors={"x": torch.zeros(2)})
    own = [Batch.from_dict(tensors={"x": torch.full((2,), float(i))}) for i in range(3)]
    # An SP-replica layout: ranks 0 and 1 get the same chunk (positional), each rank its own kwarg.
    calls = [((shared,), {"extra": own[0]}), ((shared,), {"extra": own[1]}), ((own[2],), {"extra": 7})]
    group._submit("update", calls)
    assert puts == [shared]
    sent = [w.sent[0] for w in group._workers]
    assert sent[0][0] == ("ref1",) and sent[1][0] == ("ref1",)
    assert [s[1]["extra"] for s in sent] == [own[0], own[1], 7]
    assert sent[2][0][0] is own[2]
