"""``testing.multiprocess.run_on_ranks``: results in rank order from one gloo group, and a rank
that raises fails the call with its own error (the early ``os._exit(0)`` is for finished ranks only)."""

import pytest
import torch
import torch.distributed as dist

from verl_balance.testing.multiprocess import run_on_ranks

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
