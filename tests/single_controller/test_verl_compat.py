"""verl-style worker code on our single controller, through the verl integration's extension.

Reference: verl 0.9.1's own single controller. The same worker class, written the way verl's docs
write one (verl's ``Worker``, ``register``, ``Dispatch``, ``@ray.remote``), is driven through the
same calls by verl's ``RayWorkerGroup`` and by ours (``integrations.verl.RayWorkerGroup``: verl's
constructor on our group); every result must be equal. The scenario
checks its own power: DP_COMPUTE_PROTO outputs name the rank that produced each row, so a
controller that broadcast the DataProto (each rank processing every row) would return twice the
rows with the wrong ranks.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from tests._verl import VERL_SKIP_REASON

verl = pytest.importorskip("verl", reason=VERL_SKIP_REASON)
ray = pytest.importorskip("ray")

from ray import cloudpickle  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.single_controller.base import Worker  # noqa: E402
from verl.single_controller.base.decorator import (  # noqa: E402
    Dispatch,
    Execute,
    make_nd_compute_dataproto_dispatch_fn,
    register,
)

from verl_balance import single_controller as ours  # noqa: E402
from verl_balance.integrations.verl.controller import worker_group as verl_group  # noqa: E402  (installs the extension)
from verl_balance.integrations.verl.controller.extension import drop_padding, pad_for_even_chunks  # noqa: E402
from verl_balance.single_controller.decorator import get_registration  # noqa: E402

# the worker class below is shipped to the Ray workers by value (this test module is not importable there)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NUM_WORKERS = 2


@ray.remote
class Accumulator(Worker):
    """A verl-docs-style worker: one value per rank, every predefined dispatch mode we translate."""

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.value = torch.zeros(1) + self.rank + offset
        # one mesh where every rank is its own DP group, one where both ranks replicate DP group 0
        self._register_dispatch_collect_info("dp", dp_rank=self.rank, is_collect=True)
        self._register_dispatch_collect_info("replicated", dp_rank=0, is_collect=self.rank == 0)

    @register(Dispatch.ONE_TO_ALL)
    def add(self, x):
        self.value += x
        return self.value.clone()

    @register(Dispatch.ALL_TO_ALL)
    def scale(self, factor):
        self.value *= factor
        return self.value.clone()

    @register(Dispatch.DP_COMPUTE)
    def tag(self, label):
        return f"{label}@{self.rank}"

    @register(Dispatch.DP_COMPUTE_PROTO)
    def stamp(self, data: DataProto) -> DataProto:
        rows = len(data)
        out = DataProto.from_dict(
            tensors={"x": data.batch["x"] + self.value.item(), "rank": torch.full((rows,), self.rank)},
            non_tensors={"uid": data.non_tensor_batch["uid"]},
        )
        return out

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def stamp_async(self, data: DataProto) -> DataProto:
        return self.stamp(data)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def count(self, data: DataProto) -> dict:
        return {"rank": self.rank, "rows": len(data), "first": int(data.batch["x"][0])}

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("replicated"))
    def stamp_replicated(self, data: DataProto) -> DataProto:
        return self.stamp(data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("dp"))
    def stamp_dp(self, data: DataProto) -> DataProto:
        return self.stamp(data)

    @register(Dispatch.ALL_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def first_rank(self, x):
        return {"rank": self.rank, "x": x}

    @register(Dispatch.DIRECT_ROLLOUT_METHOD)
    def direct_rollout(self):
        return self.rank


def _rows(n: int, *, auto_padding: bool = False) -> DataProto:
    data = DataProto.from_dict(
        tensors={"x": torch.arange(n, dtype=torch.float32)},
        non_tensors={"uid": np.array([f"u{i}" for i in range(n)], dtype=object)},
    )
    if auto_padding:
        data.meta_info["_verl_auto_padding"] = True
    return data


def _plain(value):
    """Results as plain Python, so verl's and ours compare with ==."""
    if isinstance(value, DataProto):
        out = {k: v.tolist() for k, v in value.batch.items()}
        out.update({k: v.tolist() for k, v in value.non_tensor_batch.items()})
        return out
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _scenario(group) -> dict:
    """Every call a verl driver makes on this worker, on fresh inputs (verl pads its inputs in place)."""
    return {
        "world_size": group.world_size,
        "add": _plain(group.add(1.0)),
        "scale": _plain(group.scale([2.0, 3.0])),
        "tag": group.tag(["a", "b"]),
        "stamp": _plain(group.stamp(_rows(6))),
        "stamp_padded": _plain(group.stamp(_rows(5, auto_padding=True))),
        "count": _plain(group.count(_rows(4))),
        # a pending result (verl: DataProtoFuture, ours: GroupFuture) is awaited with .get() or passed on
        "stamp_async": _plain(group.stamp_async(_rows(4)).get()),
        "count_of_future": _plain(group.count(group.stamp_async(_rows(4)))),
        "stamp_replicated": _plain(group.stamp_replicated(_rows(3))),
        "stamp_dp": _plain(group.stamp_dp(_rows(4))),
        "first_rank": _plain(group.first_rank([7, 8])),
        "execute_all_sync": _plain(group.execute_all_sync("add", [10.0, 20.0])),
        "execute_rank_zero_sync": _plain(group.execute_rank_zero_sync("add", 0.0)),
    }


@pytest.fixture(scope="module")
def verl_results(ray_cluster):
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    # verl's default max_colocate_count=10 reserves 10 CPUs per bundle; the test cluster has 6
    pool = RayResourcePool([NUM_WORKERS], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(cls=Accumulator, offset=0.5), device_name="cpu")
    try:
        return _scenario(group)
    finally:
        for handle in group.workers:
            ray.kill(handle)
        for pg in pool.pgs:
            ray.util.remove_placement_group(pg)


@pytest.fixture(scope="module")
def our_group(ray_cluster):
    pool = ours.RayResourcePool([NUM_WORKERS], use_gpu=False)  # exactly verl's call; our default colocate count 1
    group = verl_group.RayWorkerGroup(pool, ours.RayClassWithInitArgs(cls=Accumulator, offset=0.5), device_name="cpu")
    yield group
    group.shutdown()
    pool.remove()


@pytest.mark.slow
def test_verl_docs_worker_gives_verls_results_on_our_controller(verl_results, our_group):
    assert _scenario(our_group) == verl_results
    # the scenario can tell a split from a broadcast: rank r produced rows 3r..3r+2, x shifted by r + 1.5
    assert verl_results["stamp"]["rank"] == [0, 0, 0, 1, 1, 1]
    assert verl_results["stamp_padded"]["uid"] == [f"u{i}" for i in range(5)]  # padding row dropped
    assert verl_results["stamp_replicated"]["rank"] == [0, 0, 0]  # only the collecting rank returns


@pytest.mark.slow
def test_verl_modes_without_an_equivalent_raise_on_call_not_silently(our_group):
    with pytest.raises(ours.DispatchError, match="DIRECT_ROLLOUT_METHOD"):
        our_group.direct_rollout()
    with pytest.raises(ours.DispatchError, match="list of 2"):
        our_group.scale(2.0)  # verl would broadcast a non-list ALL_TO_ALL argument; we refuse to guess
    with pytest.raises(ours.DispatchError, match="5 rows cannot be split evenly into 2"):
        our_group.stamp(_rows(5))  # verl asserts; auto-padding is the opt-in


def test_verl_registrations_translate_to_our_modes():
    modes = {
        name: get_registration(getattr(Accumulator.__ray_actor_class__, name), name=name)
        for name in ("add", "scale", "tag", "stamp", "count", "stamp_replicated", "first_rank")
    }
    assert modes["add"].dispatch_mode is ours.Dispatch.ONE_TO_ALL
    assert modes["scale"].dispatch_mode is ours.Dispatch.ALL_TO_ALL
    assert modes["tag"].dispatch_mode is ours.Dispatch.ALL_TO_ALL
    assert modes["stamp"].dispatch_mode is ours.Dispatch.DP_COMPUTE_PROTO
    assert modes["count"].dispatch_mode is ours.Dispatch.DP_COMPUTE_METRIC
    assert modes["stamp_replicated"].dispatch_mode == ours.make_mesh_dispatch("replicated")
    # verl hands rank 0 the call's own arguments for ALL_TO_ALL + RANK_ZERO
    assert (modes["first_rank"].dispatch_mode, modes["first_rank"].execute_mode) == (
        ours.Dispatch.ONE_TO_ALL,
        ours.Execute.RANK_ZERO,
    )


def test_our_register_accepts_verl_members_and_rejects_what_has_no_equivalent():
    @ours.register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.ALL)
    def f(self, data):
        return data

    @ours.register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn("actor"))
    def g(self, data):
        return data

    assert get_registration(f).dispatch_mode is ours.Dispatch.DP_COMPUTE_PROTO
    assert get_registration(f).execute_mode is ours.Execute.ALL
    assert get_registration(g).dispatch_mode == ours.make_mesh_dispatch("actor")
    with pytest.raises(ours.DispatchError, match="DIRECT_ROLLOUT_METHOD"):
        ours.register(dispatch_mode=Dispatch.DIRECT_ROLLOUT_METHOD)
    with pytest.raises(ours.DispatchError, match="custom verl dispatch_fn"):
        ours.register(dispatch_mode={"dispatch_fn": lambda wg, *a: a, "collect_fn": lambda wg, o: o})


def test_dp_compute_proto_splits_a_dataproto_like_a_batch():
    calls = ours.decorator.dispatch_args(ours.Dispatch.DP_COMPUTE_PROTO, (_rows(6), 0.5), {}, world_size=3)
    assert [c[0][0].batch["x"].tolist() for c in calls] == [[0, 1], [2, 3], [4, 5]]
    assert [c[0][0].non_tensor_batch["uid"].tolist() for c in calls] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    assert [c[0][1] for c in calls] == [0.5] * 3
    merged = ours.decorator.collect_outputs(ours.Dispatch.DP_COMPUTE_PROTO, [c[0][0] for c in calls])
    assert isinstance(merged, DataProto) and merged.batch["x"].tolist() == list(range(6))


def test_resource_pool_takes_verls_positional_constructor():
    pool = ours.RayResourcePool([2, 2], False, "prefix", 2)
    assert (pool.n_gpus_per_node, pool.nnodes, pool.use_gpu, pool.name_prefix, pool.max_colocate_count) == (
        2,
        2,
        False,
        "prefix",
        2,
    )
    assert pool.store == [2, 2] and pool.world_size == 4 and pool.local_rank_list() == [0, 1, 0, 1]
    keyword = ours.RayResourcePool(process_on_nodes=[3], use_gpu=False)
    assert (keyword.n_gpus_per_node, keyword.nnodes, keyword.max_colocate_count) == (3, 1, 1)
    ours_form = ours.RayResourcePool(n_gpus_per_node=3, nnodes=2, use_gpu=False)
    assert ours_form.process_on_nodes == [3, 3]
    with pytest.raises(ours.UnplaceableResourcePoolError, match=r"same number of workers"):
        ours.RayResourcePool([2, 1], use_gpu=False)
    with pytest.raises(ours.UnplaceableResourcePoolError, match="not both"):
        ours.RayResourcePool([2], n_gpus_per_node=2)
    with pytest.raises(ours.UnplaceableResourcePoolError, match="detached=True is not supported"):
        ours.RayResourcePool([2], False, None, 1, True)


def test_auto_padded_dataproto_is_padded_on_a_copy_and_the_padding_dropped():
    data = _rows(5, auto_padding=True)
    (padded,), _, padding = pad_for_even_chunks((data,), {}, 2)
    assert padding == 1 and len(padded) == 6 and padded.batch["x"].tolist() == [0, 1, 2, 3, 4, 4]  # last row repeated
    assert len(data) == 5  # the caller's DataProto is untouched (verl pads it in place)
    assert drop_padding(padded, padding).batch["x"].tolist() == [0, 1, 2, 3, 4]
    # without auto-padding nothing is padded, and an uneven split is refused rather than guessed
    assert pad_for_even_chunks((_rows(5),), {}, 2)[2] == 0
    with pytest.raises(ours.DispatchError, match="argument #0: a DataProto of 5 rows"):
        ours.decorator.dispatch_args(ours.Dispatch.DP_COMPUTE_PROTO, (_rows(5),), {}, world_size=2)


def test_dp_compute_metric_splits_rows_and_returns_the_per_rank_list():
    calls = ours.decorator.dispatch_args(ours.Dispatch.DP_COMPUTE_METRIC, (_rows(4),), {}, world_size=2)
    assert [c[0][0].batch["x"].tolist() for c in calls] == [[0, 1], [2, 3]]
    outputs = [_rows(2), _rows(2)]
    assert ours.decorator.collect_outputs(ours.Dispatch.DP_COMPUTE_METRIC, outputs) is outputs


def test_worker_group_rejects_verl_options_it_cannot_honour_before_starting_anything():
    from verl.single_controller.ray import RayClassWithInitArgs as VerlClassWithInitArgs

    pool = ours.RayResourcePool([2], use_gpu=False)
    cia = ours.RayClassWithInitArgs(cls=Accumulator, offset=0.5)
    for kwargs, match in [
        ({"bin_pack": False}, "bin_pack=False"),
        ({"detached": True}, "detached=True"),
        ({"worker_names": ["a"]}, "attaching to existing"),
        ({"ray_wait_register_center_timeout": 5, "ready_timeout_s": 5}, "not both"),
    ]:
        with pytest.raises(ours.WorkerGroupError, match=match):
            verl_group.RayWorkerGroup(pool, cia, **kwargs)
    assert pool.pgs is None  # nothing was placed
    # verl's own RayClassWithInitArgs is taken over with its class, arguments and actor options
    verl_cia = VerlClassWithInitArgs(Accumulator, 0.5, tag="x")
    verl_cia.update_options({"max_concurrency": 2})
    coerced = verl_group.class_with_init_args(verl_cia)
    assert (coerced.cls, coerced.args, coerced.kwargs, coerced.options) == (
        Accumulator.__ray_actor_class__,
        (0.5,),
        {"tag": "x"},
        {"max_concurrency": 2},
    )


@pytest.mark.slow
def test_plain_group_drives_verl_workers_once_the_integration_is_imported(verl_results, ray_cluster):
    # our generic group (not the verl subclass): the installed extension reads verl's marks and meshes
    pool = ours.RayResourcePool([NUM_WORKERS], use_gpu=False)
    group = ours.RayWorkerGroup(pool, ours.RayClassWithInitArgs(cls=Accumulator, offset=0.5), device_name="cpu")
    try:
        assert _plain(group.add(1.0)) == verl_results["add"]
        assert _plain(group.scale([2.0, 3.0])) == verl_results["scale"]  # the scenario's state before stamp
        assert _plain(group.stamp(_rows(6))) == verl_results["stamp"]
        assert _plain(group.stamp(_rows(5, auto_padding=True))) == verl_results["stamp_padded"]
        assert _plain(group.stamp_replicated(_rows(3))) == verl_results["stamp_replicated"]
        assert not hasattr(group, "execute_all_sync")  # verl's method names live on the verl subclass only
    finally:
        group.shutdown()
        pool.remove()


def test_verl_marks_are_unknown_to_the_dispatcher_without_the_extension(monkeypatch):
    from verl_balance.single_controller import extensions

    method = Accumulator.__ray_actor_class__.stamp
    assert get_registration(method) is not None
    monkeypatch.setattr(extensions, "_EXTENSIONS", [])  # negative control: the extension is what reads them
    assert get_registration(method) is None
    with pytest.raises(ours.DispatchError, match="must be a Dispatch member"):
        ours.register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
