"""`RayResourcePool`: the placement groups a worker group's processes live in.

One placement group per node (``STRICT_PACK``: all bundles of a node on one Ray node), each with
``n_gpus_per_node`` bundles of ``{"CPU": cpus_per_worker * max_colocate_count, "GPU": 1}`` (or CPU
only). On a CPU-only cluster ``n_gpus_per_node`` is simply the number of CPU workers per node, so
the same config runs a laptop demo and a GPU cluster. Up to ``max_colocate_count`` worker groups
can be built on one pool (e.g. actor and rollout sharing GPUs): each of their workers takes
``cpus_per_worker`` CPUs and ``1 / max_colocate_count`` of its bundle's GPU.

Invariant: placement either succeeds within ``placement_timeout_s`` or raises
``UnplaceableResourcePoolError`` naming the resources asked for and those the cluster has, and
releases whatever it reserved. (A request larger than any node or than the whole cluster fails at
once; one that only waits for busy resources fails at the timeout.) Placement groups are ordered by
node address so that ranks map to nodes the same way across restarts (sharded checkpoints are
written per rank).
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

__all__ = ["RayResourcePool", "UnplaceableResourcePoolError"]


class UnplaceableResourcePoolError(ValueError):
    """The cluster cannot (or not within the timeout) provide the requested bundles."""


def _node_resources() -> list[dict[str, Any]]:
    return [
        {"node": node["NodeManagerAddress"], "id": node["NodeID"], "resources": node["Resources"]}
        for node in ray.nodes()
        if node.get("Alive", False)
    ]


def _format_resources(resources: dict[str, float], keys: tuple[str, ...] | None = None) -> str:
    keys = keys or tuple(k for k in ("CPU", "GPU", "memory") if k in resources)
    resources = {k: resources.get(k, 0.0) for k in keys}
    shown = {k: (round(resources[k] / 2**30, 1) if k == "memory" else resources[k]) for k in keys}
    return ", ".join(f"{k}={v}{' GiB' if k == 'memory' else ''}" for k, v in shown.items()) or "nothing"


class RayResourcePool:
    """``nnodes`` placement groups of ``n_gpus_per_node`` worker bundles each.

    Args:
        n_gpus_per_node: workers per node (GPUs per node; CPU workers when ``use_gpu`` is false).
        nnodes: number of placement groups (one per node).
        use_gpu: reserve one GPU per worker; ``None`` means "if the cluster has GPUs".
        cpus_per_worker: CPUs reserved per worker (also its torch thread count).
        placement_timeout_s: how long to wait for the cluster to place the bundles.
        max_colocate_count: how many worker groups may share each bundle.
        name_prefix: prefix of the placement-group names (default: random).
    """

    def __init__(
        self,
        *,
        n_gpus_per_node: int,
        nnodes: int = 1,
        use_gpu: bool | None = None,
        cpus_per_worker: float = 1.0,
        placement_timeout_s: float = 60.0,
        max_colocate_count: int = 1,
        name_prefix: str | None = None,
    ) -> None:
        if n_gpus_per_node < 1 or nnodes < 1:
            raise UnplaceableResourcePoolError(f"n_gpus_per_node and nnodes must be >= 1, got {n_gpus_per_node} and {nnodes}")
        if max_colocate_count < 1:
            raise UnplaceableResourcePoolError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        if cpus_per_worker < 0:
            raise UnplaceableResourcePoolError(f"cpus_per_worker must be >= 0, got {cpus_per_worker}")
        self.n_gpus_per_node = int(n_gpus_per_node)
        self.nnodes = int(nnodes)
        self._use_gpu = use_gpu
        self.cpus_per_worker = float(cpus_per_worker)
        self.max_colocate_count = int(max_colocate_count)
        self.placement_timeout_s = float(placement_timeout_s)
        self.name_prefix = name_prefix or f"vb_{uuid.uuid4().hex[:6]}"
        self._pgs: list[PlacementGroup] | None = None

    @property
    def world_size(self) -> int:
        """Total number of workers."""
        return self.n_gpus_per_node * self.nnodes

    @property
    def process_on_nodes(self) -> list[int]:
        """Workers per placement group (verl's name)."""
        return [self.n_gpus_per_node] * self.nnodes

    @property
    def use_gpu(self) -> bool:
        """Whether each worker reserves a GPU (resolved against the cluster on first use)."""
        if self._use_gpu is None:
            self._use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        return self._use_gpu

    @property
    def threads_per_worker(self) -> int:
        """Torch intra-op threads per worker: the reserved CPUs, at least one."""
        return max(1, math.floor(self.cpus_per_worker))

    def bundle(self) -> dict[str, float]:
        """Resources of one bundle (shared by up to ``max_colocate_count`` workers)."""
        bundle = {"CPU": self.cpus_per_worker * self.max_colocate_count}
        if self.use_gpu:
            bundle["GPU"] = 1.0
        return bundle

    def _asked(self) -> str:
        return (
            f"{self.nnodes} node(s) x {self.n_gpus_per_node} bundle(s) of {{{_format_resources(self.bundle())}}} "
            f"(per node {_format_resources({k: v * self.n_gpus_per_node for k, v in self.bundle().items()})}, "
            f"total {_format_resources({k: v * self.world_size for k, v in self.bundle().items()})})"
        )

    def _available(self) -> str:
        nodes = "; ".join(f"node {n['node']}: {_format_resources(n['resources'])}" for n in _node_resources())
        # Ray omits exhausted resources from available_resources(): show them as 0
        shown = tuple(k for k in ("CPU", "GPU", "memory") if k in ray.cluster_resources())
        return f"cluster total [{nodes}], currently free {{{_format_resources(ray.available_resources(), shown)}}}"

    def _infeasible_reason(self) -> str | None:
        per_node = {k: v * self.n_gpus_per_node for k, v in self.bundle().items()}
        nodes = _node_resources()
        if not any(all(n["resources"].get(k, 0) >= v for k, v in per_node.items()) for n in nodes):
            return "no node of the cluster is large enough for one node's bundles"
        total = ray.cluster_resources()
        if any(total.get(k, 0) < v * self.world_size for k, v in self.bundle().items()):
            return "the cluster as a whole is too small"
        return None

    def get_placement_groups(self) -> list[PlacementGroup]:
        """Create (once) and return the placement groups, ordered by node address."""
        if self._pgs is not None:
            return self._pgs
        if not ray.is_initialized():
            raise UnplaceableResourcePoolError("Ray is not initialized; call ray.init() (or ray.init(address=...)) first")
        reason = self._infeasible_reason()
        if reason is not None:
            raise UnplaceableResourcePoolError(f"cannot place resource pool: {reason}. Asked for {self._asked()}; {self._available()}")
        pgs = [
            placement_group([self.bundle() for _ in range(self.n_gpus_per_node)], strategy="STRICT_PACK", name=f"{self.name_prefix}_pg{i}")
            for i in range(self.nnodes)
        ]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.placement_timeout_s)
        if len(ready) < len(pgs):
            available = self._available()
            for pg in pgs:
                remove_placement_group(pg)
            raise UnplaceableResourcePoolError(
                f"resource pool not placed within placement_timeout_s={self.placement_timeout_s:g}s "
                f"({len(ready)}/{len(pgs)} node groups placed). Asked for {self._asked()}; {available}"
            )
        self._pgs = self._sort_by_node(pgs)
        return self._pgs

    @staticmethod
    def _sort_by_node(pgs: list[PlacementGroup]) -> list[PlacementGroup]:
        address_of = {n["id"]: n["node"] for n in _node_resources()}

        def node_address(indexed: tuple[int, PlacementGroup]) -> tuple[str, int]:
            index, pg = indexed
            node_ids = ray.util.placement_group_table(pg).get("bundles_to_node_id", {})
            return address_of.get(node_ids.get(0, ""), ""), index

        return [pg for _, pg in sorted(enumerate(pgs), key=node_address)]

    def remove(self) -> None:
        """Release the placement groups (workers in them are killed by Ray)."""
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs = None
