"""SIGINT / SIGTERM in every phase of a run, with the documented exit codes (docs/fault_tolerance.md,
'Exit codes').

- During the steps ``DriverBase._request_stop`` finishes the step, saves and exits with 128 + signal.
- Outside them ``interrupt_handlers`` raises ``RunInterrupted``, which releases the run directory and
  workers and exits with one line and the same code (never Ray's ``sys.exit(15)`` nor a traceback).
- ``stop_signals_blocked`` blocks both signals while the embedded Ray cluster starts, so its workers
  inherit the mask and a process-group SIGTERM reaches only the driver.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals that stop a run gracefully: the step in flight finishes, a checkpoint is saved, and the
entry points exit with 128 + the signal's number (``driver.exit_code``)."""


class RunInterrupted(BaseException):
    """SIGINT or SIGTERM outside the training steps (a ``BaseException``, so ``except Exception`` won't swallow it)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} outside the training steps (start-up, resume or "
            f"shut-down): exiting with code {self.exit_code}; the run's complete checkpoints are kept "
            "(resume with trainer.resume_mode=auto)"
        )


def _raise_interrupted(signum, frame) -> None:
    raise RunInterrupted(signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def interrupt_handlers() -> Iterator[None]:
    """While active (main thread only), SIGINT / SIGTERM raise ``RunInterrupted``; handlers installed inside win."""
    if not _in_main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _raise_interrupted) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGINT / SIGTERM in this thread (and the processes it starts meanwhile), keep the handlers,
    then unblock: a signal that arrived meanwhile is delivered then."""
    if not _in_main_thread():
        yield
        return
    handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    except SystemExit as exit_:  # Ray's handler ran: another thread took the (process-wide) SIGTERM
        if exit_.code == signal.SIGTERM:
            raise RunInterrupted(signal.SIGTERM) from None
        raise
    finally:
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
