"""SIGINT / SIGTERM in every phase (issue 50): outside the steps (start-up, resume, shut-down) the
run ends with one line and 130 / 143 (not Ray's ``sys.exit(15)``, not a KeyboardInterrupt
traceback); while the embedded Ray cluster starts, both signals are blocked so its processes (and
the workers they start) ignore a process-group SIGTERM, and a signal that arrived meanwhile is
delivered afterwards to the driver's handler, not Ray's.

Negative controls: without the block a child sees SIGTERM unblocked, and without the handlers a
SIGTERM kills the process by the signal (-15) and a SIGINT prints a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from verl_balance.trainer.signals import RunInterrupted, interrupt_handlers, stop_signals_blocked


def _blocked_signals(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("SigBlk:"):
                return int(line.split()[1], 16)
    raise AssertionError("no SigBlk")


def _wait_for_signal() -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.01)
    raise AssertionError("the signal never arrived")


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_outside_the_steps_raises_run_interrupted_with_the_exit_code(signum, code):
    before = signal.getsignal(signum)
    with pytest.raises(RunInterrupted, match=rf"{signal.Signals(signum).name} outside.*code {code}") as info:
        with interrupt_handlers():
            os.kill(os.getpid(), signum)
            _wait_for_signal()
    assert info.value.exit_code == code
    assert signal.getsignal(signum) is before  # restored


@pytest.mark.slow  # starts other processes
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="Linux /proc")
def test_processes_started_while_blocked_ignore_stop_signals_and_the_handlers_are_kept():
    previous = signal.getsignal(signal.SIGTERM)
    bit = 1 << (signal.SIGTERM - 1)
    child = plain = None
    try:
        with stop_signals_blocked():
            child = subprocess.Popen(["sleep", "30"])
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(15))  # what ray.init installs
        assert signal.getsignal(signal.SIGTERM) is previous  # the driver's handler, not Ray's
        assert _blocked_signals(child.pid) & bit
        child.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        assert child.poll() is None  # a process-group SIGTERM leaves it running
        plain = subprocess.Popen(["sleep", "30"])  # negative control: started without the block
        assert not _blocked_signals(plain.pid) & bit
        plain.send_signal(signal.SIGTERM)
        assert plain.wait(timeout=5) == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc in (child, plain):
            if proc is not None:
                proc.kill()
                proc.wait()


def test_rays_sigterm_exit_while_starting_becomes_run_interrupted():
    with pytest.raises(RunInterrupted) as info:
        with stop_signals_blocked():
            sys.exit(int(signal.SIGTERM))  # Ray's handler, run for a SIGTERM another thread took
    assert info.value.exit_code == 143
    with pytest.raises(SystemExit):  # any other exit passes through
        with stop_signals_blocked():
            sys.exit(3)


_STARTUP_SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from verl_balance.trainer.driver import DriverBase

class SlowStart(DriverBase):
    def __init__(self, cfg):
        os.kill(os.getpid(), {signum})  # arrives during start-up (e.g. the model load)
        time.sleep(10)

SlowStart.train(None)
print("finished")
"""
# Python's own handlers, also when this suite's process was started with SIGINT ignored (a background job):
_PLAIN_SCRIPT = (
    "import os, signal, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "os.kill(os.getpid(), {signum}); time.sleep(10); print('finished')"
)


@pytest.mark.slow  # starts another interpreter
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_start_up_exits_with_its_code_and_one_line(tmp_path, signum, code):
    def run(template: str) -> subprocess.CompletedProcess:
        script = tmp_path / "start.py"
        script.write_text(textwrap.dedent(template.format(root=os.getcwd(), signum=int(signum))))
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)

    done = run(_STARTUP_SCRIPT)
    assert done.returncode == code, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "finished" not in done.stdout
    assert f"error: stopped by {signal.Signals(signum).name} outside the training steps" in done.stderr
    plain = run(_PLAIN_SCRIPT)  # negative control: the default handlers
    if signum == signal.SIGTERM:
        assert plain.returncode == -signal.SIGTERM
    else:
        assert (
            plain.returncode == -signal.SIGINT and "Traceback" in plain.stderr and "KeyboardInterrupt" in plain.stderr
        )
