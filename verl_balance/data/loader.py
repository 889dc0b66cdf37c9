"""A seeded, shuffling, resumable sampler and data loader (single process, on the driver).

Order: epoch e visits ``default_rng([seed, e]).permutation(num_samples)`` (or ``arange`` without
shuffle) in consecutive batches; it depends only on (seed, epoch, num_samples, batch_size).
``drop_last=True`` (default) skips each epoch's last ``num_samples % batch_size`` samples (a different
set each epoch); ``drop_last=False`` makes the last batch smaller.

State: ``{"epoch", "position"}`` (batches of the epoch already yielded), the order settings and the
dataset's ``fingerprint()`` when it has one (resuming on different data is refused). A batch counts
as consumed once yielded, so a state saved after processing it resumes with the next batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .io import DataError


class StatefulSampler:
    """Yields int64 index batches over one epoch at a time; resumable via ``state_dict``."""

    def __init__(
        self, *, num_samples: int, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ):
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size} must be >= 1")
        if drop_last and num_samples < batch_size:
            raise DataError(
                f"batch_size={batch_size} is larger than the dataset ({num_samples} samples) with drop_last=True, "
                "so an epoch has no batch; lower the batch size or add data"
            )
        if num_samples < 1:
            raise DataError("the dataset is empty")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample order of one epoch (int64)."""
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples).astype(np.int64)

    def __iter__(self) -> Iterator[np.ndarray]:
        if self.position >= len(self):
            self.epoch, self.position = self.epoch + 1, 0
        orders: dict[int, np.ndarray] = {}
        while self.position < len(self):
            # Read per batch: another iterator (DAPO's extra generation batches) may move the epoch.
            order = orders.get(self.epoch)
            if order is None:
                orders.clear()
                order = orders[self.epoch] = self.epoch_order(self.epoch)
            start = self.position * self.batch_size
            batch = order[start : start + self.batch_size]
            self.position += 1
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """Position plus the settings that must match on resume."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved state; the order-defining settings must be unchanged."""
        for key in ("seed", "num_samples", "batch_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"cannot resume the data loader: {key} was {state[key]!r} in the checkpoint, now "
                    f"{getattr(self, key)!r}; restore the original value (the sample order depends on it)"
                )
        position = int(state["position"])
        if not 0 <= position <= len(self):
            raise DataError(f"loader state position={position} is outside [0, {len(self)}] batches per epoch")
        self.epoch, self.position = int(state["epoch"]), position


class StatefulDataLoader:
    """Batches of ``collate_fn([dataset[i] for i in indices])`` in ``StatefulSampler`` order."""

    def __init__(
        self,
        dataset: Sequence[Any],
        *,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any],
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.sampler = StatefulSampler(
            num_samples=len(dataset), batch_size=batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last
        )
        self.last_indices: np.ndarray | None = None

    @property
    def epoch(self) -> int:
        """Epoch of the next batch (see the module docstring for the roll-over rule)."""
        return self.sampler.epoch

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        for indices in self.sampler:
            self.last_indices = indices
            yield self.collate_fn([self.dataset[int(i)] for i in indices])

    def _dataset_fingerprint(self) -> str | None:
        fingerprint = getattr(self.dataset, "fingerprint", None)
        return fingerprint() if callable(fingerprint) else None

    def state_dict(self) -> dict[str, Any]:
        """Sampler state (epoch, position, order settings) and the dataset fingerprint when it has one."""
        state = self.sampler.state_dict()
        fingerprint = self._dataset_fingerprint()
        if fingerprint is not None:
            state["dataset_fingerprint"] = fingerprint
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume so the next batch is the one an uninterrupted run would produce next; DataError when the
        saved dataset fingerprint differs."""
        saved = state.get("dataset_fingerprint")
        current = self._dataset_fingerprint() if saved is not None else None
        if saved is not None and current is not None and saved != current:
            raise DataError(
                f"cannot resume the data loader: the dataset differs from the checkpoint's (fingerprint {saved} "
                f"then, {current} now): the data files, tokenizer, max_length or truncation changed; restore them "
                "to continue this run, or start a new one"
            )
        self.sampler.load_state_dict(state)
