"""The early start's exit hook (``ray_start._EarlyStart.at_exit``), in process with Ray's calls recorded: it waits
for the start, stops a running cluster the way Ray's own exit hook would (with Ray's wait for the workers' last
log lines only when the start was taken, so workers may have run), and freezes the objects left out of the
interpreter's final collection. The end-to-end side (a config error leaves no Ray process, the cluster outlives
its starting thread) is ``test_ray_early_start.py``'s."""

from __future__ import annotations

import gc

import pytest

from verl_balance.trainer import ray_start


@pytest.fixture
def recorded_ray(monkeypatch):
    calls = []
    monkeypatch.setattr(ray_start.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray_start.ray, "shutdown", lambda **kwargs: calls.append(kwargs))
    yield calls
    gc.unfreeze()


def _finished_start(*, taken: bool) -> ray_start._EarlyStart:
    early = ray_start._EarlyStart({})
    early.started.set()
    early.taken = taken
    return early


def test_an_untaken_start_is_stopped_without_waiting_for_worker_logs_and_the_objects_are_frozen(recorded_ray):
    gc.unfreeze()
    _finished_start(taken=False).at_exit()
    assert recorded_ray == [{"_exiting_interpreter": False}]
    assert gc.get_freeze_count() > 0


def test_a_taken_start_is_stopped_as_rays_exit_hook_stops_it(recorded_ray):
    _finished_start(taken=True).at_exit()
    assert recorded_ray == [{"_exiting_interpreter": True}]


def test_the_hook_waits_for_a_start_still_running(recorded_ray):
    early = ray_start._EarlyStart({})
    early.started.wait = lambda: recorded_ray.append("waited")  # stands in for the start finishing
    early.at_exit()
    assert recorded_ray[0] == "waited"  # negative control of the order: the stop comes after the wait
    assert recorded_ray[1] == {"_exiting_interpreter": False}
