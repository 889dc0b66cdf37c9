"""DataProto <-> Batch (and verl 0.9 TensorDict -> Batch) conversions lose nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

from verl import DataProto  # noqa: E402

from verl_balance.integrations.verl import batch_from_dataproto, batch_from_tensordict, batch_to_dataproto  # noqa: E402
from verl_balance.protocol import Batch  # noqa: E402


def _rich_dataproto(num_rows=5) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.randint(0, 100, (num_rows, 7), generator=gen),
            "attention_mask": torch.ones(num_rows, 7, dtype=torch.bool),
            "advantages": torch.randn(num_rows, 7, generator=gen, dtype=torch.float64),
            "pixel_values": torch.randn(num_rows, 2, 3, 4, generator=gen).to(torch.bfloat16),
        },
        non_tensors={
            "uid": np.array([f"u{i}" for i in range(num_rows)], dtype=object),
            "reward_info": np.array([{"score": i, "tags": ["a"] * i} for i in range(num_rows)], dtype=object),
            "raw_prompt_ids": np.array([list(range(i)) for i in range(num_rows)], dtype=object),
            "index": np.arange(num_rows),
        },
        meta_info={"temperature": 0.7, "global_steps": 3, "nested": {"a": [1, 2], "b": None}},
    )


def _assert_same_dataproto(a: DataProto, b: DataProto) -> None:
    if a.batch is None or b.batch is None:
        assert a.batch is None and b.batch is None
    else:
        assert set(a.batch.keys()) == set(b.batch.keys())
        for key in a.batch.keys():
            assert a.batch[key].dtype == b.batch[key].dtype and torch.equal(a.batch[key], b.batch[key]), key
    assert set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for key, column in a.non_tensor_batch.items():
        other = b.non_tensor_batch[key]
        assert column.dtype == other.dtype and column.shape == other.shape, key
        assert all(x == y for x, y in zip(column.tolist(), other.tolist())), key
    assert a.meta_info == b.meta_info


def test_dataproto_round_trip_keeps_tensors_non_tensors_and_meta():
    original = _rich_dataproto()
    batch = batch_from_dataproto(original)
    assert isinstance(batch, Batch) and len(batch) == len(original)
    assert batch.meta["nested"] == {"a": [1, 2], "b": None}
    _assert_same_dataproto(batch_to_dataproto(batch), original)


def test_batch_round_trip_through_dataproto_survives_row_operations():
    batch = batch_from_dataproto(_rich_dataproto(num_rows=6))
    # reorder on the verl side, convert back, and compare with the same reorder on our side
    proto = batch_to_dataproto(batch)
    proto.reorder(torch.tensor([5, 3, 1, 0, 2, 4]))
    ours = batch.index_select(np.array([5, 3, 1, 0, 2, 4]))
    _assert_same_dataproto(batch_to_dataproto(batch_from_dataproto(proto)), batch_to_dataproto(ours))


def test_dataproto_without_tensors_round_trips_to_batch_none():
    original = DataProto.from_dict(non_tensors={"uid": np.array(["a", "b", "c"], dtype=object)}, meta_info={"k": 1})
    batch = batch_from_dataproto(original)
    assert len(batch) == 3 and batch.tensor_keys == []
    _assert_same_dataproto(batch_to_dataproto(batch), original)


def test_verl_tensordict_converts_like_verls_own_from_tensordict():
    tensordict = _rich_dataproto().to_tensordict()
    # reference: verl's conversion (numpy columns come back as object arrays on both sides)
    _assert_same_dataproto(batch_to_dataproto(batch_from_tensordict(tensordict)), DataProto.from_tensordict(tensordict))


def test_nested_tensordict_becomes_right_padded_with_attention_mask():
    from verl.utils import tensordict_utils as tu

    rows = [torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([1, 2])]
    data = tu.get_tensordict(
        tensor_dict={"input_ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged)},
        non_tensor_dict={"max_token_len_per_gpu": 64},
    )
    batch = batch_from_tensordict(data)
    assert torch.equal(batch["input_ids"], torch.tensor([[5, 6, 7], [8, 0, 0], [1, 2, 0]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]]))
    assert batch.meta["max_token_len_per_gpu"] == 64
