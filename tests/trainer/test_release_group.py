"""``trainer.cluster.release_group`` without Ray: closing a run stops the workers and then frees the
placement, and a failure is raised; replacing a broken group tries both steps whatever happens and
logs each failure naming the group (what ``DriverBase`` and ``GRPOTrainer`` do with their groups)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from verl_balance.trainer.cluster import release_group


def _group(calls: list, *, failing: tuple[str, ...] = ()) -> SimpleNamespace:
    def step(name):
        def run():
            calls.append(name)
            if name in failing:
                raise RuntimeError(f"{name} failed")

        return run

    return SimpleNamespace(shutdown=step("shutdown"), resource_pool=SimpleNamespace(remove=step("remove")))


def test_release_stops_the_workers_then_frees_the_placement():
    calls: list = []
    release_group(_group(calls))
    assert calls == ["shutdown", "remove"]


def test_a_failing_shutdown_on_close_is_raised_before_the_placement_is_touched():
    calls: list = []
    with pytest.raises(RuntimeError, match="shutdown failed"):
        release_group(_group(calls, failing=("shutdown",)))
    assert calls == ["shutdown"]


def test_a_broken_group_is_released_best_effort_naming_it(caplog):
    calls: list = []
    with caplog.at_level(logging.WARNING, logger="verl_balance.trainer.cluster"):
        release_group(_group(calls, failing=("shutdown", "remove")), broken="the old critic group")
    assert calls == ["shutdown", "remove"]
    assert [r.getMessage() for r in caplog.records] == [
        "restart: releasing the old critic group failed: shutdown failed",
        "restart: releasing the old critic group failed: remove failed",
    ]
