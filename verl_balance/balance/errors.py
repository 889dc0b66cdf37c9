"""User-facing errors of the balancer: each a `ValueError` naming the argument or sample and what is valid."""

from __future__ import annotations


class BalanceInputError(ValueError):
    """Base class: the balancer was given input it cannot plan (bad config or bad data)."""


class EmptyBatchError(BalanceInputError):
    """No samples to plan (an empty batch, or every sample skipped as over-long)."""


class InvalidLengthError(BalanceInputError):
    """A sequence length is negative or not an integer."""


class TooFewSamplesError(BalanceInputError):
    """Fewer samples (or groups) than DP ranks while equal per-rank counts are required."""


class OverlongSampleError(BalanceInputError):
    """A sample or an atomic group holds more tokens than one micro-batch may carry."""


class BalanceConfigError(BalanceInputError):
    """An argument combination or value is invalid (dp_size < 1, both micro_batch_size and cap, ...)."""
