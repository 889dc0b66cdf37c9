"""Resuming verl's train loader state, in this process (fast lane).

- ``patches/loader_state.py``: a ``StatefulDataLoader`` state saved under one ``num_workers`` resumes
  under another (verl's ``data.dataloader_num_workers``) and yields the rest of the epoch the saving
  loader would have yielded (the reference: that loader, uninterrupted). Negative control: torchdata's
  own loader refuses the same state with the AssertionError of issue 49.
- ``backend/trainer_files.py``: the ``data.pt`` / ``data_<rank>.pt`` files verl unpickles with
  ``weights_only=False`` after our engine's load are refused when they hold a planted payload
  (which does not run), are symlinks or are not a dict; the state verl really saves passes.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)
stateful = pytest.importorskip("torchdata.stateful_dataloader")

from verl_balance.integrations.verl.backend.trainer_files import trainer_file_paths, trainer_files_problem  # noqa: E402
from verl_balance.integrations.verl.patches.loader_state import (  # noqa: E402
    LoaderStateError,
    convert_loader_state,
    resumable_loader_class,
    saved_num_workers,
)

DATA = list(range(24))
BATCH = 4  # 6 batches an epoch
ResumableLoader = resumable_loader_class(stateful.StatefulDataLoader)


def make_loader(num_workers: int, *, shuffle: bool, cls=ResumableLoader):
    """verl's train loader as ``create_rl_sampler`` builds it (torchdata's RandomSampler with a seeded
    generator, or a SequentialSampler), ``drop_last=True``."""
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(7)
        sampler = stateful.sampler.RandomSampler(DATA, generator=generator)
    else:
        sampler = torch.utils.data.SequentialSampler(DATA)
    return cls(DATA, batch_size=BATCH, num_workers=num_workers, drop_last=True, sampler=sampler)


def saved_after(num_workers: int, steps: int, *, shuffle: bool) -> tuple[dict, list[list[int]]]:
    """(the state after ``steps`` batches, the batches the same loader yields after them)."""
    loader = make_loader(num_workers, shuffle=shuffle)
    it = iter(loader)
    for _ in range(steps):
        next(it)
    state = loader.state_dict()
    return state, [batch.tolist() for batch in it]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's set_vital deprecation
        yield


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("saved", "resumed"), [(2, 0), (0, 2), (2, 3), (0, 0), (2, 2)])
def test_a_state_saved_under_one_num_workers_resumes_the_epoch_under_another(saved, resumed, shuffle):
    state, rest = saved_after(saved, 2, shuffle=shuffle)
    assert len(rest) == 4
    loader = make_loader(resumed, shuffle=shuffle)
    loader.load_state_dict(state)
    assert [batch.tolist() for batch in loader] == rest
    # The next epoch starts afresh (all 6 batches, each sample once).
    assert sorted(i for batch in loader for i in batch.tolist()) == DATA


def test_torchdatas_own_loader_refuses_the_other_layout_the_issue_49_error():
    state, _ = saved_after(2, 1, shuffle=False)
    plain = make_loader(0, shuffle=False, cls=stateful.StatefulDataLoader)
    plain.load_state_dict(state)
    with pytest.raises(AssertionError, match="_num_yielded"):
        iter(plain)


def test_a_state_saved_after_the_epochs_last_batch_resumes_to_an_empty_rest_then_a_new_epoch():
    # What verl saves at an epoch boundary (the last batch yielded, StopIteration not yet seen); the
    # legacy trainer skips loading it, the v1 trainer loads it and starts the next epoch on StopIteration.
    state, rest = saved_after(2, 6, shuffle=False)
    assert rest == []
    converted = convert_loader_state(state, num_workers=0, base_seed=0)
    assert converted["_num_yielded"] == 6 and converted["_iterator_finished"] is False
    loader = make_loader(0, shuffle=False)
    loader.load_state_dict(state)
    assert [batch.tolist() for batch in loader] == []
    assert [batch.tolist() for batch in loader] == [DATA[i : i + BATCH] for i in range(0, len(DATA), BATCH)]


def test_the_layout_is_read_from_the_state_and_foreign_or_per_worker_states_are_named():
    single, _ = saved_after(0, 1, shuffle=False)
    multi, _ = saved_after(3, 1, shuffle=False)
    assert saved_num_workers(single) == 0 and saved_num_workers(multi) == 3
    assert convert_loader_state(multi, num_workers=3, base_seed=0) is multi  # the same layout: untouched
    assert convert_loader_state({}, num_workers=2, base_seed=0) == {}
    with pytest.raises(LoaderStateError, match="not written by torchdata"):
        convert_loader_state({"epoch": 3}, num_workers=0, base_seed=0)
    workers = {**multi["_snapshot"]["_worker_snapshots"], "worker_1": {"worker_id": 1, "dataset_state": {"pos": 5}}}
    per_worker = {**multi, "_snapshot": {**multi["_snapshot"], "_worker_snapshots": workers}}
    with pytest.raises(LoaderStateError, match="dataloader_num_workers=3"):
        convert_loader_state(per_worker, num_workers=0, base_seed=0)
    iterable = {**single, "fetcher_state": {"dataset_iter_state": None, "fetcher_ended": False}}
    with pytest.raises(LoaderStateError, match="dataloader_num_workers=0"):
        convert_loader_state(iterable, num_workers=2, base_seed=0)


class PlantedPayload:
    """A pickle that writes ``marker`` when unpickled (what a planted data.pt would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def checkpoint(tmp_path):
    """verl's main_ppo layout: global_step_2/{actor/, data.pt} with the state verl really saves."""
    step = tmp_path / "global_step_2"
    (step / "actor").mkdir(parents=True)
    loader = make_loader(0, shuffle=True)
    next(iter(loader))
    torch.save(loader.state_dict(), step / "data.pt")
    return step


def test_the_loader_state_verl_saves_passes_the_trainer_file_check(checkpoint):
    actor = str(checkpoint / "actor")
    assert trainer_file_paths(actor) == [str(checkpoint / "data.pt")]
    assert trainer_files_problem(actor) is None


def test_a_planted_payload_in_data_pt_is_refused_without_running(checkpoint, tmp_path):
    marker = tmp_path / "payload_ran"
    torch.save({"_num_yielded": 1, "x": PlantedPayload(str(marker))}, checkpoint / "data.pt")
    problem = trainer_files_problem(str(checkpoint / "actor"))
    assert problem is not None and "data.pt" in problem and "weights_only=False" in problem
    assert "GLOBAL io.open" in problem  # names what the pickle asked for
    assert not marker.exists()
    # Negative control: verl's own read of the file (weights_only=False) runs it.
    torch.load(checkpoint / "data.pt", weights_only=False)
    assert marker.exists()


def test_symlinked_or_non_dict_trainer_files_are_refused_and_sft_files_inside_are_checked(checkpoint, tmp_path):
    actor = str(checkpoint / "actor")
    outside = tmp_path / "outside.pt"
    os.replace(checkpoint / "data.pt", outside)
    os.symlink(outside, checkpoint / "data.pt")
    assert "symlink" in trainer_files_problem(actor)
    os.remove(checkpoint / "data.pt")
    assert trainer_files_problem(actor) is None  # no file: verl starts the data order afresh
    # sft_trainer: data_<dp rank>.pt inside the engine's own directory
    torch.save([1, 2], checkpoint / "data_1.pt")
    torch.save(torch.load(outside), checkpoint / "data_0.pt")
    assert trainer_file_paths(str(checkpoint)) == [str(checkpoint / "data_0.pt"), str(checkpoint / "data_1.pt")]
    assert "data_1.pt holds a list" in trainer_files_problem(str(checkpoint))
