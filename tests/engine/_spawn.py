"""Deprecated shim: use ``verl_balance.testing.multiprocess.run_on_ranks`` (tests/models still
import this path; delete the shim once they switch)."""

from verl_balance.testing.multiprocess import run_on_ranks

__all__ = ["run_on_ranks"]
