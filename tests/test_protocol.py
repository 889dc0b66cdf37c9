"""Batch operations against hand-built expectations (plan dispatch: tests/trainer/test_plan_dispatch.py)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl_balance.protocol import Batch, BatchError, UnknownKeyError


def make_batch(n: int = 6) -> Batch:
    """Row i carries i everywhere, so any row permutation is visible in every column."""
    return Batch.from_dict(
        tensors={
            "input_ids": torch.arange(n * 3).reshape(n, 3),
            "score": torch.arange(n, dtype=torch.float32) / 10,
        },
        non_tensors={"uid": [f"s{i}" for i in range(n)], "tools": [[i, i] for i in range(n)]},
        meta={"temperature": 1.0},
    )


def assert_rows(batch: Batch, rows: list[int]) -> None:
    """``batch`` holds exactly rows ``rows`` of ``make_batch``, in that order, in every column."""
    rows_t = torch.tensor(rows, dtype=torch.long)
    assert len(batch) == len(rows)
    assert torch.equal(batch["input_ids"], (rows_t[:, None] * 3 + torch.arange(3)).reshape(len(rows), 3))
    assert torch.equal(batch["score"], rows_t.float() / 10)
    assert batch["uid"].tolist() == [f"s{i}" for i in rows]
    assert batch["tools"].tolist() == [[i, i] for i in rows]


# ---------------------------------------------------------------- construction and columns


def test_columns_and_aliases_match_dataproto_names():
    b = make_batch()
    assert len(b) == 6
    assert isinstance(b.batch, TensorDict) and b.batch is b.tensors and b.batch.batch_size == torch.Size([6])
    assert b.non_tensor_batch is b.non_tensors and b.meta_info is b.meta
    assert b["tools"].dtype == object and b["tools"].shape == (6,)  # nested lists stay objects
    assert sorted(b.tensor_keys) == ["input_ids", "score"] and sorted(b.non_tensor_keys) == ["tools", "uid"]


def test_mismatched_row_counts_are_rejected():
    with pytest.raises(BatchError, match="different numbers of rows"):
        Batch.from_dict(tensors={"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(BatchError, match="different numbers of rows"):
        Batch.from_dict(tensors={"a": torch.zeros(3)}, non_tensors={"u": ["x", "y"]})
    with pytest.raises(BatchError, match="rows"):
        Batch(tensors=TensorDict({"a": torch.zeros(3)}, batch_size=[3]), non_tensors={"u": ["x"]})
    b = make_batch()
    with pytest.raises(BatchError, match="6 rows"):
        b["new"] = torch.zeros(5)


def test_unknown_keys_name_the_valid_ones():
    b = make_batch()
    with pytest.raises(UnknownKeyError, match="available: \\['input_ids', 'score'\\]"):
        b.select(batch_keys=["nope"])
    with pytest.raises(UnknownKeyError, match="nope"):
        b.pop(non_tensor_batch_keys=["nope"])
    with pytest.raises(KeyError):  # also a KeyError, like a dict lookup
        b["nope"]
    with pytest.raises(ValueError):  # and a ValueError, per the project's error convention
        b["nope"]


def test_setitem_routes_tensors_and_non_tensors():
    b = make_batch(3)
    b["adv"] = torch.ones(3, 2)
    b["tag"] = ["a", "b", "c"]
    assert "adv" in b.tensor_keys and b["tag"].tolist() == ["a", "b", "c"]


def test_select_keeps_only_named_columns_and_shares_storage():
    b = make_batch()
    s = b.select(batch_keys=["score"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert s.tensor_keys == ["score"] and s.non_tensor_keys == ["uid"] and s.meta == {}
    assert s["score"].data_ptr() == b["score"].data_ptr()
    assert sorted(b.tensor_keys) == ["input_ids", "score"]  # source untouched
    deep = b.select(batch_keys=["score"], deepcopy=True)
    assert deep["score"].data_ptr() != b["score"].data_ptr() and torch.equal(deep["score"], b["score"])


def test_pop_moves_columns_out():
    b = make_batch()
    popped = b.pop(batch_keys=["score"], non_tensor_batch_keys=["uid"], meta_info_keys=["temperature"])
    assert b.tensor_keys == ["input_ids"] and b.non_tensor_keys == ["tools"] and b.meta == {}
    assert popped.tensor_keys == ["score"] and popped.non_tensor_keys == ["uid"] and popped.meta == {"temperature": 1.0}
    assert len(popped) == 6


def test_union_adds_columns_in_place_and_rejects_conflicts():
    b = make_batch()
    extra = Batch.from_dict(
        tensors={"old_log_probs": torch.full((6, 3), -1.0)}, non_tensors={"uid": b["uid"]}, meta={"step": 2}
    )
    out = b.union(extra)
    assert out is b and "old_log_probs" in b.tensor_keys and b.meta == {"temperature": 1.0, "step": 2}
    with pytest.raises(BatchError, match="'score' differs"):
        b.union(Batch.from_dict(tensors={"score": torch.zeros(6)}))
    with pytest.raises(BatchError, match="6 and 5 rows"):
        b.union(make_batch(5))
    with pytest.raises(BatchError, match="'temperature' differs"):
        b.union(Batch.from_dict(tensors={"score": b["score"]}, meta={"temperature": 0.5}))


# ---------------------------------------------------------------- row operations


def test_index_select_and_getitem_pick_the_same_rows_in_every_column():
    b = make_batch()
    assert_rows(b.index_select([4, 0, 4]), [4, 0, 4])
    assert_rows(b[np.array([5, 1])], [5, 1])
    assert_rows(b[torch.tensor([2, 3])], [2, 3])
    assert_rows(b[np.array([True, False, True, False, False, True])], [0, 2, 5])
    assert_rows(b[1:5:2], [1, 3])
    assert_rows(b.index_select([]), [])
    assert b.index_select([1]).meta == {"temperature": 1.0}


def test_index_select_rejects_out_of_range_and_bad_masks():
    b = make_batch()
    with pytest.raises(BatchError, match="out of range"):
        b.index_select([0, 6])
    with pytest.raises(BatchError, match="boolean mask has 2 entries"):
        b[np.array([True, False])]
    with pytest.raises(TypeError, match="ambiguous"):
        b[0]


def test_reorder_is_an_in_place_permutation():
    b = make_batch()
    assert b.reorder(torch.tensor([5, 4, 3, 2, 1, 0])) is b
    assert_rows(b, [5, 4, 3, 2, 1, 0])
    with pytest.raises(BatchError, match="permutation"):
        b.reorder([0, 0, 1, 2, 3, 4])


def test_chunk_sizes_differ_by_at_most_one_and_cover_all_rows():
    b = make_batch(7)
    chunks = b.chunk(3)
    assert [len(c) for c in chunks] == [3, 2, 2]
    assert_rows(chunks[0], [0, 1, 2])
    assert_rows(chunks[2], [5, 6])
    assert [len(c) for c in make_batch(6).chunk(3)] == [2, 2, 2]  # DataProto.chunk when divisible
    assert [len(c) for c in make_batch(2).chunk(4)] == [1, 1, 0, 0]


def test_split_by_size_or_by_list_of_sizes():
    b = make_batch(7)
    assert [len(c) for c in b.split(3)] == [3, 3, 1]
    pieces = b.split([2, 0, 5])
    assert [len(c) for c in pieces] == [2, 0, 5]
    assert_rows(pieces[2], [2, 3, 4, 5, 6])
    with pytest.raises(BatchError, match="sum to the batch's 7 rows"):
        b.split([3, 3])


def test_concat_inverts_split_and_checks_columns():
    b = make_batch(7)
    assert_rows(Batch.concat(b.split([3, 0, 4])), list(range(7)))
    with pytest.raises(BatchError, match="batch 1 has columns"):
        Batch.concat([b, b.select(batch_keys=["score"])])
    with pytest.raises(BatchError, match="empty list"):
        Batch.concat([])
    with pytest.raises(BatchError, match="incompatible shapes"):
        Batch.concat(
            [
                b,
                Batch.from_dict(
                    tensors={"input_ids": torch.zeros(1, 4, dtype=torch.long), "score": torch.zeros(1)},
                    non_tensors={"uid": ["x"], "tools": [[0]]},
                ),
            ]
        )


def test_concat_merges_meta_and_gathers_metrics():
    a = Batch.from_dict(tensors={"x": torch.zeros(1)}, meta={"t": 1, "metrics": {"loss": 1.0}})
    c = Batch.from_dict(tensors={"x": torch.ones(1)}, meta={"t": 1, "metrics": {"loss": 3.0}})
    merged = Batch.concat([a, c])
    assert merged.meta == {"t": 1, "metrics": {"loss": [1.0, 3.0]}}
    with pytest.raises(BatchError, match="meta key 't' differs"):
        Batch.concat([a, Batch.from_dict(tensors={"x": torch.ones(1)}, meta={"t": 2})])


def test_repeat_interleaved_and_tiled():
    b = make_batch(3)
    assert_rows(b.repeat(2), [0, 0, 1, 1, 2, 2])
    assert_rows(b.repeat(2, interleave=False), [0, 1, 2, 0, 1, 2])


def test_to_moves_tensors_in_place():
    b = make_batch(2)
    assert b.to("cpu") is b and b["input_ids"].device.type == "cpu"


def test_pickle_round_trip_keeps_every_column():
    b = make_batch(4)
    b2 = pickle.loads(pickle.dumps(b))
    assert_rows(b2, [0, 1, 2, 3])
    assert b2.meta == b.meta and b2.tensors.batch_size == torch.Size([4])


def test_non_tensor_only_batch_has_rows():
    b = Batch.from_dict(non_tensors={"uid": ["a", "b", "c"]})
    assert len(b) == 3 and [len(c) for c in b.chunk(2)] == [2, 1]
    assert Batch.concat(b.chunk(2))["uid"].tolist() == ["a", "b", "c"]
