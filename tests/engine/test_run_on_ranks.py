"""``distributed.launcher.run_on_ranks``: results in rank order from one gloo group; warm ranks
that start each call from a fresh process's state; a rank that raises, hangs or dies fails the call
promptly (with its own error) and the next call gets fresh ranks."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from verl_balance.distributed.launcher import RankFailedError, run_on_ranks

pytestmark = pytest.mark.slow  # spawns processes


def _rank_world_and_sum(rank):
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return rank, dist.get_world_size(), float(value)


def _rank_one_raises(rank):
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    return rank


def test_results_come_back_in_rank_order_from_one_gloo_group():
    assert run_on_ranks(_rank_world_and_sum, world=3) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def test_a_rank_that_raises_fails_the_call_with_its_error():
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        run_on_ranks(_rank_one_raises, world=2, init_group=False)


def _pid_and_state(rank):
    """The process, and what it starts from: torch's first random draw, the caller's env and cwd."""
    return os.getpid(), float(torch.rand(1)), os.environ.get("RUN_ON_RANKS_PROBE"), os.getcwd()


def _patch_a_library_global(rank):
    """What a negative control does in a rank (tests/engine/test_materialize.py): rebind a module's
    function for this call only; a warm rank must not carry it into the next call."""
    import json

    from verl_balance.engine import materialize

    materialize.copy_local_rows = lambda *a, **k: None
    json.dumps = None
    return rank


def _library_globals(rank):
    import json

    from verl_balance.engine import materialize

    return materialize.copy_local_rows.__name__, json.dumps.__name__


def _rank_zero_raises_while_rank_one_waits_in_a_collective(rank):
    if rank == 0:
        raise ValueError("rank 0 failed before the all_reduce")
    dist.all_reduce(torch.ones(1))  # never completes: rank 0 is gone
    return rank


def _rank_one_hangs(rank):
    if rank == 1:
        time.sleep(3600)
    return rank


def _rank_one_dies(rank):
    if rank == 1:
        os._exit(7)
    return rank


def test_the_ranks_are_warm_and_each_call_starts_from_a_fresh_process_state(tmp_path, monkeypatch):
    first = run_on_ranks(_pid_and_state, world=2)
    monkeypatch.setenv("RUN_ON_RANKS_PROBE", "second call")
    monkeypatch.chdir(tmp_path)
    second = run_on_ranks(_pid_and_state, world=2)
    assert [r[0] for r in second] == [r[0] for r in first]  # the same processes: no start-up
    assert len({r[0] for r in first} | {os.getpid()}) == 3
    # torch's random state as the process started with it (a fresh process seeds it at random), every call
    assert [r[1] for r in first] == [r[1] for r in second]
    fresh = run_on_ranks(_pid_and_state, world=2, fresh=True)
    assert not {r[0] for r in fresh} & {r[0] for r in first}
    assert [r[2:] for r in second] == [("second call", str(tmp_path))] * 2
    assert [r[2] for r in first] == [None, None]


def test_a_module_global_rebound_in_one_call_is_restored_for_the_next():
    assert run_on_ranks(_library_globals, world=2) == [("copy_local_rows", "dumps")] * 2
    run_on_ranks(_patch_a_library_global, world=2)
    assert run_on_ranks(_library_globals, world=2) == [("copy_local_rows", "dumps")] * 2


# The hanging and dying ranks run without a gloo group: with one, the rank that returns at once tears
# the group down while its slower peer (on a loaded machine) may still be connecting, and that peer's
# "connection closed" error, not the hang or the death under test, would be the first report.
@pytest.mark.parametrize(
    ("fn", "init_group", "timeout_s", "message"),
    [
        (
            _rank_zero_raises_while_rank_one_waits_in_a_collective,
            True,
            120,
            "(?s)^rank 0 of 2 raised:.*before the all_reduce",
        ),
        (_rank_one_hangs, False, 5, r"rank\(s\) \[(0, )?1\] of 2 did not answer within 5 s"),
        (_rank_one_dies, False, 120, r"rank 1 of 2 died \(exit code 7\)"),
    ],
    ids=["raises", "hangs", "dies"],
)
def test_a_failed_rank_fails_the_call_promptly_and_the_next_call_gets_fresh_ranks(fn, init_group, timeout_s, message):
    pids = [r[0] for r in run_on_ranks(_pid_and_state, world=2)]
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=message):
        run_on_ranks(fn, world=2, timeout_s=timeout_s, init_group=init_group)
    assert time.monotonic() - start < 60  # nobody waited for gloo's 30-minute collective timeout
    again = run_on_ranks(_rank_world_and_sum, world=2)
    assert again == [(0, 2, 3.0), (1, 2, 3.0)]
    assert not set(pids) & {r[0] for r in run_on_ranks(_pid_and_state, world=2)}  # the failed pool was replaced
