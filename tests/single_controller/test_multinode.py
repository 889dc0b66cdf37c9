"""Placement on clusters of their own: a simulated 2-node Ray cluster, and the trainer's embedded one.

Each scenario runs in a fresh interpreter (tests/single_controller/cluster_scenarios.py) because
it starts its own Ray cluster. References: the single-node run of the same dp=2 x sp=2 training
(losses equal to rtol 1e-6), Ray's own record of where each placement group and worker landed,
and the machine's core count.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from verl_balance.testing.forked_workers import python_command

pytestmark = pytest.mark.slow

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_scenario(name: str, timeout_s: float = 900) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.pop("RAY_ADDRESS", None)
    result = subprocess.run(
        python_command(["-m", "tests.single_controller.cluster_scenarios", name]),
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=timeout_s,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    output = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0 and lines, f"scenario {name} failed:\n{output}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def multinode(ray_cluster):
    """The two-node scenario (its own cluster, in a fresh interpreter) and, as ``single``, its
    single-node reference run on the test session's cluster."""
    from tests.single_controller.cluster_scenarios import single_node_run

    return {**run_scenario("multinode"), "single": single_node_run()}


def test_nnodes_2_on_a_one_node_cluster_is_an_immediate_error(multinode):
    error = multinode["one_node_error"]
    assert error is not None, "two placement groups were packed onto the only node"
    assert "nnodes=2 needs 2 distinct Ray nodes" in error and "has 1 such node(s)" in error
    assert multinode["one_node_error_s"] < 10


def test_one_placement_group_per_node_and_ranks_ordered_by_node(multinode):
    multi = multinode["multi"]
    pg_nodes = multi["pg_nodes"]
    assert sorted(pg_nodes) == multinode["nodes"]  # one group on each of the two nodes
    assert pg_nodes == sorted(pg_nodes)  # same address on a simulated cluster: ordered by node id
    assert multi["node_of_rank"] == [pg_nodes[0]] * 2 + [pg_nodes[1]] * 2  # node-major ranks
    assert multi["local_rank"] == [0, 1, 0, 1]
    # each SP group (consecutive ranks) lives on one node: the all-to-all stays inside the node
    assert multi["dp_sp_of_rank"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    single = multinode["single"]
    assert len(set(single["node_of_rank"])) == 1 and single["local_rank"] == [0, 1, 2, 3]


def test_dp2_sp2_training_across_two_nodes_equals_the_single_node_run(multinode):
    multi, single = multinode["multi"]["losses"], multinode["single"]["losses"]
    assert len(multi) == len(single) == 2
    for step_multi, step_single in zip(multi, single):
        assert step_multi == pytest.approx(step_single, rel=1e-6)
    # the second step's loss depends on the first update: equal curves mean equal updates
    assert multi[1][0] != pytest.approx(multi[0][0], rel=1e-6)


def test_oversized_request_on_the_embedded_cluster_fails_at_once():
    out = run_scenario("oversized")
    assert out["cluster_cpus"] == out["expected_cpus"] == 4 * len(os.sched_getaffinity(0))  # sized to the machine
    assert out["error"] is not None and "Asked for 1 node(s) x 64 bundle(s)" in out["error"]
    assert f"CPU={out['cluster_cpus']}" in out["error"]
    assert out["placement_s"] < 30  # at once, not after placement_timeout_s=300
    assert out["free_cpus_after"] == out["cluster_cpus"]  # nothing left reserved, no worker spawned
    # the embedded cluster's workers are not deprioritised below the driver (Ray's default is 15)
    assert out["worker_niceness"] == out["driver_niceness"]
