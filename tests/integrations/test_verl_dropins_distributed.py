"""rearrange_micro_batches and loss_counts across a real 2-rank gloo DP group (one spawn, many cases).

Invariants: every DP rank gets the same number of micro-batches whatever its own data needs; the
count honours min_num_micro_batch and num_batches_divided_by; a fatal condition on one rank makes
every rank raise (no rank is left waiting in a collective); loss counts are summed over DP.
"""

from __future__ import annotations

import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.distributed.launcher import run_on_ranks

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

pytestmark = pytest.mark.slow

WORLD = 2

# per case: (lengths on rank 0, lengths on rank 1, max_token_len, kwargs)
CASES = {
    "uneven_needs": ([60] * 8, [5] * 8, 128, {}),
    "min_count": ([10] * 6, [10] * 9, 100, {"min_num_micro_batch": 4}),
    "divided_by": ([50] * 5, [20] * 5, 110, {"num_batches_divided_by": 2}),
    "overlong_on_one_rank": ([10, 10], [10, 200], 128, {}),
    "too_few_rows_on_one_rank": ([100] * 6, [1], 128, {}),
}


def _batch(lengths):
    from tensordict import TensorDict

    lengths = torch.tensor(lengths)
    width = int(lengths.max())
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    return TensorDict({"input_ids": mask.clone(), "attention_mask": mask}, batch_size=[len(lengths)])


def _worker(rank):
    """Every case on this rank of a 2-rank gloo group."""
    import torch.distributed as dist

    from verl_balance.integrations.verl import loss_counts, rearrange_micro_batches

    results = {}
    for name, (rank0, rank1, cap, kwargs) in CASES.items():
        lengths = (rank0, rank1)[rank]
        try:
            _, indices = rearrange_micro_batches(_batch(lengths), cap, dp_group=dist.group.WORLD, **kwargs)
            results[name] = ("ok", indices)
        except ValueError as exc:
            results[name] = ("error", type(exc).__name__)
    mask = torch.ones(rank + 2, 3)  # rank 0: 2 rows x 3 tokens, rank 1: 3 rows x 3 tokens
    results["loss_counts"] = loss_counts([mask[:1], mask[1:]], dp_group=dist.group.WORLD)
    dist.barrier()
    return results


@pytest.fixture(scope="module")
def rank_results():
    return run_on_ranks(_worker, world=WORLD)


@pytest.mark.parametrize("case", ["uneven_needs", "min_count", "divided_by"])
def test_every_dp_rank_gets_the_same_number_of_capped_micro_batches(rank_results, case):
    rank_lengths, cap, kwargs = CASES[case][:2], CASES[case][2], CASES[case][3]
    counts = []
    for rank, results in enumerate(rank_results):
        status, indices = results[case]
        assert status == "ok", indices
        lengths = rank_lengths[rank]
        assert sorted(sum(indices, [])) == list(range(len(lengths)))
        assert all(idx and sum(lengths[i] for i in idx) <= cap for idx in indices)
        counts.append(len(indices))
    assert len(set(counts)) == 1, counts
    own_need = [-(-sum(lengths) // cap) for lengths in rank_lengths]
    assert counts[0] >= max(own_need + [kwargs.get("min_num_micro_batch", 0)])
    if "num_batches_divided_by" in kwargs:
        assert counts[0] % kwargs["num_batches_divided_by"] == 0


@pytest.mark.parametrize(
    "case, error", [("overlong_on_one_rank", "OverlongSampleError"), ("too_few_rows_on_one_rank", "TooFewSamplesError")]
)
def test_a_fatal_condition_on_one_rank_raises_on_every_rank(rank_results, case, error):
    assert [results[case] for results in rank_results] == [("error", error)] * WORLD


def test_loss_counts_are_summed_over_the_dp_group(rank_results):
    # 2 + 3 rows of 3 loss tokens each
    assert [r["loss_counts"].num_tokens for r in rank_results] == [15, 15]
    assert [r["loss_counts"].num_sequences for r in rank_results] == [5, 5]
