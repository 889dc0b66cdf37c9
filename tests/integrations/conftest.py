"""Shared fixtures for the verl integration tests; every test here needs verl (the `verl` extra)."""

from __future__ import annotations

import pytest

VERL_SKIP_REASON = "verl is not installed; install the extra with: pip install 'verl-balance[verl]'"


@pytest.fixture(scope="session")
def verl():
    """The verl package, or skip the test with the install hint."""
    return pytest.importorskip("verl", reason=VERL_SKIP_REASON)
