"""Several worker groups share one resource pool up to max_colocate_count, and no further."""

from __future__ import annotations

import pytest

from verl_balance.single_controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup, Worker

pytestmark = pytest.mark.slow  # Ray worker processes


def test_groups_share_bundles_up_to_max_colocate_count(ray_cluster):
    pool = RayResourcePool(n_gpus_per_node=1, use_gpu=False, max_colocate_count=2)
    assert pool.bundle() == {"CPU": 2.0}
    groups = []
    try:
        groups = [RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(Worker)) for _ in range(2)]
        infos = [g.get_rank_info()[0] for g in groups]
        assert [i["rank"] for i in infos] == [0, 0] and infos[0]["pid"] != infos[1]["pid"]
        with pytest.raises(TimeoutError, match=r"Worker.__init__: worker rank\(s\) \[0\] did not finish within 2"):
            RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(Worker), ready_timeout_s=2)
    finally:
        for g in groups:
            g.shutdown()
        pool.remove()
