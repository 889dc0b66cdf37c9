"""Loader: per-epoch coverage, drop_last semantics, and resume == uninterrupted order."""

import itertools

import numpy as np
import pytest

from verl_balance.data import DataError, StatefulDataLoader, StatefulSampler


def _stream(sampler, num_batches):
    """The first num_batches batches over as many epochs as needed, with their epochs."""
    out = []
    while len(out) < num_batches:
        for batch in sampler:
            out.append((sampler.epoch, batch.tolist()))
            if len(out) == num_batches:
                break
    return out


@pytest.mark.parametrize("drop_last", [True, False])
def test_each_epoch_visits_samples_at_most_once_and_all_without_drop_last(drop_last):
    sampler = StatefulSampler(num_samples=10, batch_size=3, seed=1, drop_last=drop_last)
    for _ in range(3):
        batches = [b.tolist() for b in sampler]
        flat = list(itertools.chain.from_iterable(batches))
        assert len(flat) == len(set(flat))
        if drop_last:
            assert len(batches) == 3 and all(len(b) == 3 for b in batches)
        else:
            assert sorted(flat) == list(range(10)) and [len(b) for b in batches] == [3, 3, 3, 1]


def test_epochs_are_shuffled_differently_and_reproducibly():
    first = [b.tolist() for b in StatefulSampler(num_samples=32, batch_size=32, seed=0)]
    again = [b.tolist() for b in StatefulSampler(num_samples=32, batch_size=32, seed=0)]
    assert first == again and first[0] != list(range(32))
    sampler = StatefulSampler(num_samples=32, batch_size=32, seed=0)
    epochs = [next(iter(sampler)).tolist() for _ in range(2)]
    assert epochs[0] != epochs[1]
    assert [b.tolist() for b in StatefulSampler(num_samples=5, batch_size=2, shuffle=False)] == [[0, 1], [2, 3]]


@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_from_any_step_continues_the_uninterrupted_order(drop_last):
    total = 12  # spans 3+ epochs of 4 (or 3) batches
    reference = _stream(StatefulSampler(num_samples=11, batch_size=3, seed=7, drop_last=drop_last), total)
    for stop in range(total + 1):
        first = StatefulSampler(num_samples=11, batch_size=3, seed=7, drop_last=drop_last)
        head = _stream(first, stop) if stop else []
        resumed = StatefulSampler(num_samples=11, batch_size=3, seed=7, drop_last=drop_last)
        resumed.load_state_dict(dict(first.state_dict()))
        tail = _stream(resumed, total - stop) if total - stop else []
        assert [b for _, b in head + tail] == [b for _, b in reference], f"stop={stop}"


def test_resume_with_changed_order_settings_is_refused():
    state = StatefulSampler(num_samples=10, batch_size=2, seed=0).state_dict()
    with pytest.raises(DataError, match="seed was 0 in the checkpoint, now 1"):
        StatefulSampler(num_samples=10, batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="num_samples"):
        StatefulSampler(num_samples=12, batch_size=2, seed=0).load_state_dict(state)


def test_batch_larger_than_dataset_with_drop_last_is_an_error():
    with pytest.raises(DataError, match="batch_size=8 is larger than the dataset"):
        StatefulSampler(num_samples=5, batch_size=8)


def test_data_loader_collates_the_sampled_items_and_resumes():
    data = [np.array([i]) for i in range(9)]
    loader = StatefulDataLoader(data, batch_size=2, collate_fn=np.concatenate, seed=3)
    iterator = iter(loader)
    first = next(iterator)
    assert first.tolist() == loader.last_indices.tolist()
    state = loader.state_dict()
    rest = [b.tolist() for b in iterator]
    resumed = StatefulDataLoader(data, batch_size=2, collate_fn=np.concatenate, seed=3)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == rest and len(loader) == 4
