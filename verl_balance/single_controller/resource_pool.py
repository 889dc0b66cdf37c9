"""`RayResourcePool`: the placement groups a worker group's processes live in.

One ``STRICT_PACK`` placement group per node, each pinned to a different Ray node, of
``n_gpus_per_node`` bundles (on a CPU-only cluster: CPU workers per node). Up to
``max_colocate_count`` worker groups share one pool.

Invariants: placement succeeds within ``placement_timeout_s`` or raises
``UnplaceableResourcePoolError`` naming the resources asked for and available, releasing what it
reserved. Placement groups are ordered by node address, so ranks map to nodes the same way across
restarts, and ranks are node-major.

verl's constructor is accepted as is; two defaults differ: ``max_colocate_count=1`` and
``use_gpu=None`` (GPU bundles only if the cluster has GPUs).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from verl_balance.single_controller.worker import CORE_SHARE_PREFIX

__all__ = ["RayResourcePool", "UnplaceableResourcePoolError"]


class UnplaceableResourcePoolError(ValueError):
    """The cluster cannot (or not within the timeout) provide the requested bundles."""


NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its own id: a bundle label selector on it pins a bundle to a node."""


def _node_resources() -> list[dict[str, Any]]:
    return [
        {"node": node["NodeManagerAddress"], "id": node["NodeID"], "resources": node["Resources"]}
        for node in ray.nodes()
        if node.get("Alive", False)
    ]


def _free_resources_per_node() -> dict[str, dict[str, float]]:
    """Currently free resources by node id (Ray has no public per-node view; verl uses the same call)."""
    try:
        return dict(ray._private.state.available_resources_per_node())
    except Exception:  # noqa: BLE001 - only a preference for free nodes is lost
        return {}


def _format_resources(resources: dict[str, float], keys: tuple[str, ...] | None = None) -> str:
    keys = keys or tuple(k for k in ("CPU", "GPU", "memory") if k in resources)
    resources = {k: resources.get(k, 0.0) for k in keys}
    shown = {k: (round(resources[k] / 2**30, 1) if k == "memory" else resources[k]) for k in keys}
    return ", ".join(f"{k}={v}{' GiB' if k == 'memory' else ''}" for k, v in shown.items()) or "nothing"


class RayResourcePool:
    """``nnodes`` placement groups (one per Ray node) of ``n_gpus_per_node`` worker bundles each.

    Args (verl's positional order first):
        process_on_nodes: verl's form of the size, e.g. ``[4, 4]``; or give ``n_gpus_per_node``.
        use_gpu: reserve one GPU per worker; ``None`` means "if the cluster has GPUs".
        name_prefix: prefix of the placement-group names (default: random).
        max_colocate_count: how many worker groups may share each bundle.
        detached: not supported (must be False).
        accelerator_type: Ray accelerator resource each GPU bundle also asks for.
        n_gpus_per_node: workers per node.
        nnodes: number of nodes when ``n_gpus_per_node`` is given; default 1.
        cpus_per_worker: CPUs reserved per worker. ``None``: 1 CPU (a CPU worker then gets an
            equal share of the node's cores as threads).
        cpu_workers_per_node: CPU workers sharing one node's cores (default this pool's
            ``n_gpus_per_node x max_colocate_count``).
        placement_timeout_s: how long to wait for the cluster to place the bundles.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int] | None = None,
        use_gpu: bool | None = None,
        name_prefix: str | None = None,
        max_colocate_count: int = 1,
        detached: bool = False,
        accelerator_type: str | None = None,
        *,
        n_gpus_per_node: int | None = None,
        nnodes: int | None = None,
        cpus_per_worker: float | None = None,
        cpu_workers_per_node: int | None = None,
        placement_timeout_s: float = 60.0,
    ) -> None:
        n_gpus_per_node, nnodes = self._resolve_size(process_on_nodes, n_gpus_per_node, nnodes)
        if max_colocate_count < 1:
            raise UnplaceableResourcePoolError(f"max_colocate_count must be >= 1, got {max_colocate_count}")
        if cpus_per_worker is not None and cpus_per_worker < 0:
            raise UnplaceableResourcePoolError(f"cpus_per_worker must be >= 0, got {cpus_per_worker}")
        if detached:
            raise UnplaceableResourcePoolError(
                "detached=True is not supported: placement groups live as long as the driver that created them"
            )
        self.n_gpus_per_node = n_gpus_per_node
        self.nnodes = nnodes
        self._use_gpu = use_gpu
        self._share_cores = cpus_per_worker is None
        own = self.n_gpus_per_node * int(max_colocate_count)
        if cpu_workers_per_node is not None and cpu_workers_per_node < own:
            raise UnplaceableResourcePoolError(
                f"cpu_workers_per_node={cpu_workers_per_node} is fewer than this pool's own {own} workers per node"
            )
        self.cpu_workers_per_node = own if cpu_workers_per_node is None else int(cpu_workers_per_node)
        self.cpus_per_worker = 1.0 if cpus_per_worker is None else float(cpus_per_worker)
        self.max_colocate_count = int(max_colocate_count)
        self.accelerator_type = accelerator_type
        self.placement_timeout_s = float(placement_timeout_s)
        self.name_prefix = name_prefix or f"vb_{uuid.uuid4().hex[:6]}"
        self._pgs: list[PlacementGroup] | None = None

    @staticmethod
    def _resolve_size(
        process_on_nodes: Sequence[int] | None, n_gpus_per_node: int | None, nnodes: int | None
    ) -> tuple[int, int]:
        if process_on_nodes is not None:
            if n_gpus_per_node is not None or nnodes is not None:
                raise UnplaceableResourcePoolError(
                    f"give either process_on_nodes={list(process_on_nodes)} (verl's form) or "
                    f"n_gpus_per_node/nnodes, not both (got n_gpus_per_node={n_gpus_per_node}, nnodes={nnodes})"
                )
            counts = list(process_on_nodes)
            if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
                raise UnplaceableResourcePoolError(
                    f"process_on_nodes must be a non-empty list of positive worker counts per node, got {counts}"
                )
            if len(set(counts)) != 1:
                raise UnplaceableResourcePoolError(
                    f"process_on_nodes={counts}: every node must run the same number of workers "
                    "(ranks and the device mesh assume it; verl's worker group does too)"
                )
            return counts[0], len(counts)
        if n_gpus_per_node is None:
            raise UnplaceableResourcePoolError(
                "give the pool's size: process_on_nodes=[workers per node, ...] or n_gpus_per_node=... (and nnodes=...)"
            )
        nnodes = 1 if nnodes is None else nnodes
        if n_gpus_per_node < 1 or nnodes < 1:
            raise UnplaceableResourcePoolError(
                f"n_gpus_per_node and nnodes must be >= 1, got {n_gpus_per_node} and {nnodes}"
            )
        return int(n_gpus_per_node), int(nnodes)

    @property
    def world_size(self) -> int:
        """Total number of workers."""
        return self.n_gpus_per_node * self.nnodes

    @property
    def process_on_nodes(self) -> list[int]:
        """Workers per placement group (verl's name)."""
        return [self.n_gpus_per_node] * self.nnodes

    @property
    def store(self) -> list[int]:
        """Workers per placement group (verl's ``ResourcePool.store``)."""
        return self.process_on_nodes

    def local_world_size_list(self) -> list[int]:
        """For each rank, the number of workers on its node (verl's ``ResourcePool`` API)."""
        return [self.n_gpus_per_node] * self.world_size

    def local_rank_list(self) -> list[int]:
        """For each rank, its index on its node (verl's ``ResourcePool`` API)."""
        return [local for _ in range(self.nnodes) for local in range(self.n_gpus_per_node)]

    @property
    def pgs(self) -> list[PlacementGroup] | None:
        """The placement groups once placed, else None (verl's attribute)."""
        return self._pgs

    @property
    def use_gpu(self) -> bool:
        """Whether each worker reserves a GPU (resolved against the cluster on first use)."""
        if self._use_gpu is None:
            self._use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        return self._use_gpu

    @property
    def threads_per_worker(self) -> str:
        """Torch intra-op threads per worker: the reserved CPUs when ``cpus_per_worker`` was given or
        workers hold GPUs, else an equal share of the node's cores. Invariant: the threads of a
        node's workers sum to at most its cores."""
        if self._share_cores and not self.use_gpu:
            return f"{CORE_SHARE_PREFIX}{self.cpu_workers_per_node}"
        return str(max(1, math.floor(self.cpus_per_worker)))

    def bundle(self) -> dict[str, float]:
        """Resources of one bundle (shared by up to ``max_colocate_count`` workers)."""
        bundle = {"CPU": self.cpus_per_worker * self.max_colocate_count}
        if self.use_gpu:
            bundle["GPU"] = 1.0
            if self.accelerator_type is not None:
                bundle[self.accelerator_type] = 1e-4
        return bundle

    def _per_node(self) -> dict[str, float]:
        return {k: v * self.n_gpus_per_node for k, v in self.bundle().items()}

    def _asked(self) -> str:
        keys = tuple(self.bundle())
        return (
            f"{self.nnodes} node(s) x {self.n_gpus_per_node} bundle(s) of {{{_format_resources(self.bundle(), keys)}}} "
            f"(per node {_format_resources(self._per_node(), keys)}, "
            f"total {_format_resources({k: v * self.world_size for k, v in self.bundle().items()}, keys)})"
        )

    def _available(self) -> str:
        nodes = "; ".join(f"node {n['node']}: {_format_resources(n['resources'])}" for n in _node_resources())
        # Ray omits exhausted resources from available_resources(): show them as 0
        shown = tuple(k for k in ("CPU", "GPU", "memory") if k in ray.cluster_resources())
        return f"cluster total [{nodes}], currently free {{{_format_resources(ray.available_resources(), shown)}}}"

    def _hosting_nodes(self) -> list[dict[str, Any]]:
        """Alive nodes large enough (in total) for one node's bundles, in placement order."""
        per_node = self._per_node()
        fits = [n for n in _node_resources() if all(n["resources"].get(k, 0) >= v for k, v in per_node.items())]
        free = _free_resources_per_node()

        def order(node: dict[str, Any]) -> tuple[bool, str, str]:
            free_now = all(free.get(node["id"], node["resources"]).get(k, 0) >= v for k, v in per_node.items())
            return not free_now, node["node"], node["id"]

        return sorted(fits, key=order)

    def _infeasible_reason(self, hosting: list[dict[str, Any]]) -> str | None:
        if not hosting:
            return "no node of the cluster is large enough for one node's bundles"
        if len(hosting) < self.nnodes:
            return (
                f"nnodes={self.nnodes} needs {self.nnodes} distinct Ray nodes that can each host one node's bundles, "
                f"but the cluster has {len(hosting)} such node(s); lower nnodes (and raise n_gpus_per_node) "
                "or add nodes"
            )
        total = ray.cluster_resources()
        if any(total.get(k, 0) < v * self.world_size for k, v in self.bundle().items()):
            return "the cluster as a whole is too small"
        return None

    def get_placement_groups(
        self, strategy: str = "STRICT_PACK", name: str | None = None, device_name: str | None = None
    ) -> list[PlacementGroup]:
        """Create (once) and return the placement groups, ordered by node. Only ``STRICT_PACK``;
        ``name`` replaces the prefix; ``device_name`` must agree with ``use_gpu``."""
        if self._pgs is not None:
            return self._pgs
        if strategy != "STRICT_PACK":
            raise UnplaceableResourcePoolError(
                f"strategy={strategy!r} is not supported: each node's workers form one STRICT_PACK placement group"
            )
        if not ray.is_initialized():
            raise UnplaceableResourcePoolError(
                "Ray is not initialized; call ray.init() (or ray.init(address=...)) first"
            )
        check_device_name(device_name, use_gpu=self.use_gpu)
        hosting = self._hosting_nodes()
        reason = self._infeasible_reason(hosting)
        if reason is not None:
            raise UnplaceableResourcePoolError(
                f"cannot place resource pool: {reason}. Asked for {self._asked()}; {self._available()}"
            )
        prefix = name or self.name_prefix
        bundles = [self.bundle() for _ in range(self.n_gpus_per_node)]
        if self.nnodes == 1:
            pgs = [placement_group(bundles, strategy="STRICT_PACK", name=f"{prefix}_pg0")]
        else:
            # Several STRICT_PACK groups may land on one big node; pin group i to node i instead.
            pgs = [
                placement_group(
                    bundles,
                    strategy="STRICT_PACK",
                    name=f"{prefix}_pg{i}",
                    bundle_label_selector=[{NODE_ID_LABEL: node["id"]}] * len(bundles),
                )
                for i, node in enumerate(hosting[: self.nnodes])
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

    def node_ids(self) -> list[str]:
        """The Ray node id of each placement group, in placement-group (= rank-block) order."""
        return [_pg_node_id(pg) for pg in self.get_placement_groups()]

    @staticmethod
    def _sort_by_node(pgs: list[PlacementGroup]) -> list[PlacementGroup]:
        address_of = {n["id"]: n["node"] for n in _node_resources()}
        node_ids = [_pg_node_id(pg) for pg in pgs]
        assert len(pgs) == 1 or len(set(node_ids)) == len(pgs), f"placement groups share a node: {node_ids}"
        order = sorted(range(len(pgs)), key=lambda i: (address_of.get(node_ids[i], ""), node_ids[i], i))
        return [pgs[i] for i in order]

    def remove(self) -> None:
        """Release the placement groups (workers in them are killed by Ray)."""
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs = None


def _pg_node_id(pg: PlacementGroup) -> str:
    node_ids = set(ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).values())
    assert len(node_ids) == 1, f"a STRICT_PACK placement group spans nodes {node_ids}"
    return node_ids.pop()


DEVICE_NAMES = ("cpu", "cuda")


def check_device_name(device_name: str | None, *, use_gpu: bool) -> None:
    """verl's ``device_name``: None/"cuda"/"cpu"; "cpu" with GPU bundles is an error ("cuda" with a
    CPU pool is accepted, as in verl)."""
    if device_name is None:
        return
    if device_name not in DEVICE_NAMES:
        raise UnplaceableResourcePoolError(
            f"device_name={device_name!r} is not supported; expected one of {list(DEVICE_NAMES)}"
        )
    if device_name == "cpu" and use_gpu:
        raise UnplaceableResourcePoolError(
            "device_name='cpu' but the resource pool reserves GPUs (use_gpu); pass use_gpu=False for CPU workers"
        )
