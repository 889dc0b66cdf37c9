"""Behaviour pin: the balancer gives exactly the plans of the committed snapshot (golden_plans.py).

A refactor of plan_balance and its steps must leave every plan bit-identical: the same sample
indices in the same micro-batches on the same ranks, and the same predicted figures (floats
compared exactly). The control below shows the comparison sees a one-index change.
"""

from __future__ import annotations

import json

import pytest

from tests.balance import golden_plans

SNAPSHOT = json.loads(golden_plans.SNAPSHOT.read_text())


def _case_id(entry) -> str:
    return "-".join(f"{k}={v}" for k, v in entry["case"].items())


@pytest.mark.parametrize("entry", SNAPSHOT["plan_balance"], ids=_case_id)
def test_plan_balance_gives_the_snapshot_plan_exactly(entry):
    assert golden_plans.run_plan_case(entry["case"]) == entry["plan"]


@pytest.mark.parametrize("entry", SNAPSHOT["get_seqlen_balanced_partitions"], ids=_case_id)
def test_verl_partition_drop_in_gives_the_snapshot_parts_exactly(entry):
    assert golden_plans.run_partition_case(entry["case"]) == entry["parts"]


@pytest.mark.parametrize("entry", SNAPSHOT["rearrange_micro_batches"], ids=_case_id)
def test_verl_rearrange_drop_in_gives_the_snapshot_micro_batches_exactly(entry):
    pytest.importorskip("verl", reason="verl is not installed; install the extra: pip install 'verl-balance[verl]'")
    assert golden_plans.run_rearrange_case(entry["case"]) == entry["micro"]


def test_snapshot_comparison_detects_a_moved_index_and_a_changed_figure():
    entry = SNAPSHOT["plan_balance"][0]
    plan = golden_plans.run_plan_case(entry["case"])
    moved = json.loads(json.dumps(plan))
    rank = moved["micro_batches"][0]
    rank[0], rank[-1] = rank[0][:-1], rank[-1] + rank[0][-1:]
    assert moved != entry["plan"]
    nudged = json.loads(json.dumps(plan))
    nudged["stats"]["sync_cost"] = float(nudged["stats"]["sync_cost"]) * (1 + 2**-52)
    assert nudged != entry["plan"]
    assert plan == entry["plan"]
