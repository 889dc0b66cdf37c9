"""verl's train-loader state across a change of ``data.dataloader_num_workers`` on resume.

torchdata's ``StatefulDataLoader`` (0.11) saves two layouts: with ``num_workers=0`` a flat dict
(``_num_yielded``, the sampler's state, ...), with ``num_workers=N>0`` a ``_snapshot`` of the main
process (the same sampler fields plus ``_num_workers`` and ``_base_seed``) and one entry per worker.
It loads only the layout it writes: a ``num_workers=0`` loader given the other layout fails with
``AssertionError: State doesn't contain key '_num_yielded' expected for single process dataloader``
(the reverse asserts ``'_snapshot'``, and another N asserts in ``_restore_main_state``). verl's
``main_ppo`` saves the state as ``data.pt`` and defaults to ``dataloader_num_workers=8``, so a run
resumed with another value (``0`` is what CPU and debugging setups use) stops there.

For a map-style data set (verl's ``RLHFDataset``) the position in the epoch is the sampler's state
and the number of batches yielded; the workers hold nothing but an optional data-set state, equal
in each. ``convert_loader_state`` rewrites a saved state into the layout of the resuming loader
from exactly those fields, so the resumed loader yields the batches the saved one would have.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LoaderStateError", "convert_loader_state", "saved_num_workers"]

SNAPSHOT, MAIN, WORKERS = "_snapshot", "_main_snapshot", "_worker_snapshots"
STEP, SINCE, LAST_WORKER = "_snapshot_step", "_steps_since_snapshot", "_last_yielded_worker_id"
NUM_WORKERS, BASE_SEED, NUM_YIELDED = "_num_workers", "_base_seed", "_num_yielded"
FINISHED, DATASET, FETCHER = "_iterator_finished", "dataset_state", "fetcher_state"
SAMPLER_FIELDS = (
    "_index_sampler_state",
    "_sampler_iter_state",
    "_sampler_iter_yielded",
    "_IterableDataset_len_called",
    "_shared_seed",
)


class LoaderStateError(ValueError):
    """A saved data-loader state that cannot be resumed with the configured number of workers."""


def saved_num_workers(state: dict) -> int:
    """The ``num_workers`` of the loader that saved ``state`` (0: single process)."""
    if SNAPSHOT in state:
        return int(state[SNAPSHOT][MAIN][NUM_WORKERS])
    if NUM_YIELDED in state:
        return 0
    raise LoaderStateError(
        f"the saved data-loader state has neither '{NUM_YIELDED}' nor '{SNAPSHOT}' (keys: {sorted(state)[:8]}): "
        "it was not written by torchdata's StatefulDataLoader. Delete the checkpoint's data.pt to restart "
        "the data order at the epoch's start"
    )


def _common_form(state: dict, saved: int) -> dict[str, Any]:
    """The layout-free fields: the sampler's, batches yielded, finished flag, the data set's state."""
    if saved == 0:
        return {
            **{key: state[key] for key in SAMPLER_FIELDS},
            NUM_YIELDED: state[NUM_YIELDED],
            FINISHED: state[FINISHED],
            DATASET: state.get(DATASET),
            FETCHER: state.get(FETCHER),
        }
    snapshot = state[SNAPSHOT]
    workers = list(snapshot[WORKERS].values())
    datasets = [worker.get(DATASET) for worker in workers]
    if any(worker.get(FETCHER) is not None for worker in workers) or any(ds != datasets[0] for ds in datasets):
        raise LoaderStateError(
            f"the saved data-loader state (num_workers={saved}) holds per-worker state (an iterable or "
            "stateful data set): it resumes only with the same data.dataloader_num_workers. "
            f"Set data.dataloader_num_workers={saved}"
        )
    if state.get(SINCE, 0):
        raise LoaderStateError(
            f"the saved data-loader state is {state[SINCE]} batches past its last snapshot "
            f"(snapshot_every_n_steps > 1): it resumes only with data.dataloader_num_workers={saved}"
        )
    return {
        **{key: snapshot[MAIN][key] for key in SAMPLER_FIELDS},
        NUM_YIELDED: snapshot[STEP],
        FINISHED: state[FINISHED],
        DATASET: datasets[0] if datasets else None,
        FETCHER: None,
    }


def convert_loader_state(state: dict, *, num_workers: int, base_seed: int) -> dict:
    """``state`` in the layout a loader with ``num_workers`` loads (unchanged if it already is).

    ``base_seed`` seeds the workers of a multi-process layout made from a single-process one (the
    loader draws a fresh one per epoch anyway); a multi-process state keeps its own."""
    if not state:
        return state
    saved = saved_num_workers(state)
    if saved == num_workers:
        return state
    common = _common_form(state, saved)
    if common[FETCHER] is not None:
        raise LoaderStateError(
            "the saved data-loader state holds an iterable data set's position: it resumes only with the same "
            f"data.dataloader_num_workers. Set data.dataloader_num_workers={saved}"
        )
    if num_workers == 0:
        return common
    seed = state[SNAPSHOT][MAIN][BASE_SEED] if saved else base_seed
    yielded = common[NUM_YIELDED]
    worker_state = {DATASET: common[DATASET], FETCHER: None}
    return {
        SNAPSHOT: {
            STEP: yielded,
            # map-style batches go to the workers round-robin: batch k came from worker k % N
            LAST_WORKER: (yielded - 1) % num_workers,
            MAIN: {**{key: common[key] for key in SAMPLER_FIELDS}, NUM_WORKERS: num_workers, BASE_SEED: seed},
            WORKERS: {f"worker_{i}": {"worker_id": i, **worker_state} for i in range(num_workers)},
        },
        SINCE: 0,
        FINISHED: common[FINISHED],
    }


def resumable_loader_class(original: type) -> type:
    """A subclass of verl's ``StatefulDataLoader`` whose ``load_state_dict`` first converts the saved
    state to this loader's ``num_workers`` (``convert_loader_state``); everything else is the original's."""

    class ResumableStatefulDataLoader(original):
        """``StatefulDataLoader`` that resumes a state saved under another ``num_workers``."""

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            import torch

            seed = int(torch.empty((), dtype=torch.int64).random_(generator=self.generator).item())
            super().load_state_dict(convert_loader_state(state_dict, num_workers=self.num_workers, base_seed=seed))

    ResumableStatefulDataLoader.__module__ = __name__
    ResumableStatefulDataLoader.__qualname__ = f"Resumable{original.__name__}"
    return ResumableStatefulDataLoader
