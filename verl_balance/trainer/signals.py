"""SIGINT / SIGTERM in every phase of a run, with the documented exit codes (docs/fault_tolerance.md,
'Exit codes').

- During the steps the driver's own handler (``DriverBase._request_stop``) finishes the step,
  saves and exits with 128 + the signal (130 / 143).
- Outside them (start-up, model load, resume, shut-down) ``interrupt_handlers`` turns the signal
  into ``RunInterrupted``, which unwinds like an error (the run directory and workers are released)
  and ends the process with one line and the same code (130 / 143): never Ray's ``sys.exit(15)``
  nor a ``KeyboardInterrupt`` traceback.
- ``stop_signals_blocked`` blocks both signals in this thread while the embedded Ray cluster
  starts: its daemons and, through them, the workers inherit the blocked mask, so a SIGTERM to the
  whole process group (SLURM, Kubernetes, Ctrl-C in a terminal) reaches only the driver, which
  still has its workers to save with.
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
    """SIGINT or SIGTERM outside the training steps: the run stops (a ``BaseException``, like
    ``KeyboardInterrupt``, so no ``except Exception`` swallows it)."""

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
    """While active (main thread only), SIGINT / SIGTERM raise ``RunInterrupted``; the previous
    handlers come back on exit. Handlers installed inside (the training loop's) take precedence."""
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
    """Block SIGINT / SIGTERM in this thread (so in the processes it starts meanwhile), keep the
    handlers as they were (Ray's ``ray.init`` installs a ``sys.exit(15)`` one), then unblock: a
    signal that arrived meanwhile is delivered to those handlers. Another thread of this process
    may still take a process-directed signal meanwhile; Ray's handler then raises ``SystemExit(15)``,
    which becomes ``RunInterrupted(SIGTERM)``."""
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
