"""The run log: everything the console shows, also in ``<default_local_dir>/<job>.log``.

While a ``RunLog`` is active, ``sys.stdout`` and ``sys.stderr`` are tees (console + log): each line
reaches the log exactly once; terminal-only output (the tqdm bar) never does. ``capture()`` buffers
until ``attach(path)`` opens the file. A failed write to the file (a full disk) stops the file,
never the console, and the run keeps its own exit code.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
from collections.abc import Iterator
from typing import TextIO

from verl_balance.utils.atomic_io import open_nofollow
from verl_balance.utils.disk import disk_full_text, is_disk_full

__all__ = ["RunLog", "attach", "capture", "console_stream", "show_bar", "write_log_only"]

_active: RunLog | None = None
_bar = None
"""The terminal's progress bar (a tqdm) while one is shown; None otherwise."""
_ANSI_COLOR = re.compile(r"\x1b\[[0-9;]*m")


class _Tee(io.TextIOBase):
    """A text stream writing to the console stream and to the run log."""

    def __init__(self, console: TextIO, log: RunLog) -> None:
        self.console, self._log = console, log
        self._pending = ""
        """Text after the last newline, held back while a bar is shown on a terminal."""

    def write(self, text: str) -> int:
        self._log.write(text)
        if _bar is None and not self._pending or not self.console.isatty():
            written = self.console.write(text)
            return written if written is not None else len(text)
        self._pending += text
        if "\n" in self._pending:
            lines, _, self._pending = self._pending.rpartition("\n")
            self._write_around_bar(lines + "\n")
        return len(text)

    def _write_around_bar(self, text: str) -> None:
        bar = _bar
        if bar is None:
            self.console.write(text)
            return
        with bar.get_lock():
            bar.clear(nolock=True)
            self.console.write(text)
            self.console.flush()
            bar.refresh(nolock=True)

    def flush(self) -> None:
        if self._pending:
            text, self._pending = self._pending, ""
            self._write_around_bar(text)
        self.console.flush()
        self._log.flush()

    def isatty(self) -> bool:
        return self.console.isatty()

    def fileno(self) -> int:
        return self.console.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.console, "encoding", "utf-8")

    def __getattr__(self, name):
        return getattr(self.console, name)


class RunLog:
    """Tees the console into a buffer, then (after ``open``) into a file. See the module docstring."""

    def __init__(self) -> None:
        self._sink: io.StringIO | TextIO = io.StringIO()
        self.path: str | None = None
        self._saved: tuple[TextIO, TextIO] = (sys.stdout, sys.stderr)
        self._handlers: list[tuple[logging.StreamHandler, TextIO]] = []
        self.owned_by_driver = False

    def start(self) -> RunLog:
        """Install the tees on sys.stdout/sys.stderr and the console logging handlers."""
        global _active
        assert _active is None, "a run log is already active"
        out, err = self._saved = (sys.stdout, sys.stderr)
        tees = {id(out): _Tee(out, self), id(err): _Tee(err, self)}
        sys.stdout, sys.stderr = tees[id(out)], tees[id(err)]
        for handler in _stream_handlers():
            if id(handler.stream) in tees:
                self._handlers.append((handler, handler.stream))
                handler.setStream(tees[id(handler.stream)])
        _active = self
        return self

    def open(self, path: str) -> None:
        """Write the buffered console into ``path`` (appended) and log there from now on."""
        if self.path == path:
            return
        if self.path is not None:
            self._sink.close()
            self._sink = io.StringIO()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        buffered = self._sink.getvalue()
        self._sink = open_nofollow(path, "a")  # a link planted at the log's name is refused, naming it
        self.path = path
        try:
            self._sink.write(buffered)
            self._sink.flush()
        except OSError as err:
            self._stop_file(err)

    def write(self, text: str) -> None:
        if not self._sink.closed:
            try:
                self._sink.write(_ANSI_COLOR.sub("", text))  # Ray colours the workers' prefixes
            except OSError as err:
                self._stop_file(err)

    def flush(self) -> None:
        if not self._sink.closed:
            try:
                self._sink.flush()
            except OSError as err:
                self._stop_file(err)

    def _stop_file(self, err: OSError) -> None:
        """Close the file that can no longer be written and say so once on the console."""
        sink, self._sink = self._sink, io.StringIO()
        self._sink.close()
        with contextlib.suppress(OSError):
            sink.close()
        why = disk_full_text("write the run log", os.path.dirname(self.path or ".")) if is_disk_full(err) else err
        print(f"warning: the run log {self.path} stopped: {why}", file=self._saved[1], flush=True)

    def close(self) -> None:
        """Restore the console streams and handlers and close the file (idempotent)."""
        global _active
        if _active is not self:
            return
        for handler, stream in self._handlers:
            handler.setStream(stream)
        sys.stdout, sys.stderr = self._saved
        self._sink.close()
        _active = None


def _stream_handlers() -> Iterator[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                yield handler


@contextlib.contextmanager
def capture() -> Iterator[RunLog]:
    """Buffer the console from now on; a driver's ``attach`` gives it its file. Closed on exit."""
    log = RunLog().start()
    try:
        yield log
    finally:
        log.close()


def attach(path: str) -> RunLog:
    """The active run log, now writing to ``path``; a new one owned by the caller (who closes it)
    when none is active."""
    log = _active
    if log is not None and log.owned_by_driver and log.path not in (None, path):
        log.close()  # a driver that was never closed: its log ends here
        log = None
    if log is None:
        log = RunLog().start()
        log.owned_by_driver = True
    log.open(path)
    return log


def console_stream(stream: TextIO) -> TextIO:
    """The console behind ``stream`` (a tee's console side): output that must not reach the log."""
    return stream.console if isinstance(stream, _Tee) else stream


def show_bar(bar) -> None:
    """``bar`` (a tqdm on the console) is shown from now on; None: no bar any more."""
    global _bar
    _bar = bar


def write_log_only(text: str) -> None:
    """``text`` into the active run log only (what the terminal shows as a bar)."""
    if _active is not None:
        _active.write(text)
        _active.flush()
