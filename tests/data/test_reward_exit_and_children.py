"""Reward code can neither end the run as a success nor outlive it (issue 50): ``sys.exit(0)`` in a
reward function (or at its import) is a named ``RewardError`` (the CLI's exit code 2), and the
processes reward calls leave running (children, their descendants, a group of their own) are ended
by ``RewardChildren.reap`` while a process that existed before is left alone. No Ray.

Negative controls: the plain call raises ``SystemExit`` (what ended a run with rc 0), and the
processes left by the reward are alive until ``reap``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from verl_balance.rewards import load_reward_fn
from verl_balance.rewards.children import RewardChildren, _stat
from verl_balance.rewards.score import RewardError
from verl_balance.rewards.watchdog import score_batch_watched

SAMPLES = dict(data_sources=["a", "b"], solutions=["1", "2"], ground_truths=["1", "2"], extra_infos=[None] * 2)


def exits_on_b(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "b":
        sys.exit(0)
    return 1.0


def test_sys_exit_in_a_reward_is_a_named_error_not_a_silent_success():
    with pytest.raises(SystemExit):  # negative control: the bare call would end the process with 0
        exits_on_b("b", "2", "2")
    with pytest.raises(RewardError, match=r"SystemExit\(0\).*sample 1 \(data_source 'b'\).*must return a score"):
        score_batch_watched(reward_fn=exits_on_b, timeout_s=5, heartbeat_s=None, **SAMPLES)


@pytest.mark.slow  # starts another process
def test_sys_exit_in_a_reward_exits_the_cli_with_2_not_0(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {os.getcwd()!r})
            from tests.data.test_reward_exit_and_children import SAMPLES, exits_on_b
            from verl_balance.rewards.watchdog import score_batch_watched
            from verl_balance.trainer.config.cli import user_errors
            with user_errors():
                score_batch_watched(reward_fn=exits_on_b, timeout_s=5, heartbeat_s=None, **SAMPLES)
            print("finished")
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: the reward function raised SystemExit(0)" in done.stderr and "finished" not in done.stdout


def test_sys_exit_at_a_reward_files_import_is_a_named_error(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text("import sys\nsys.exit(0)\ndef compute_score(*a):\n    return 1.0\n")
    with pytest.raises(RewardError, match=r"failed to import: SystemExit\(0\)"):
        load_reward_fn(str(path))


_DURATIONS = [f"{600 + i}.{os.getpid()}" for i in range(3)]  # unique to this process: no other sleep matches


def _forks(data_source, solution_str, ground_truth, extra_info=None):
    """Leaves a child, a grandchild under a shell, and a new session with a member whose leader exits."""
    subprocess.Popen(["sleep", _DURATIONS[0]])
    subprocess.Popen(["sh", "-c", f"sleep {_DURATIONS[1]} & wait"])
    subprocess.Popen(["sh", "-c", f"sleep {_DURATIONS[2]} & exit 0"], start_new_session=True)
    return 1.0


def _sleepers() -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if cmd[:1] == [b"sleep"] and cmd[1:2] in [[d.encode()] for d in _DURATIONS] and _stat(int(name)):
                out.append(int(name))
    return out


@pytest.mark.slow  # starts another process
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="Linux /proc")
def test_processes_left_by_reward_calls_are_reaped_and_older_ones_kept(tmp_path):
    before = subprocess.Popen(["sleep", "603"])  # started before any reward call: never the reward's
    children = RewardChildren()
    try:
        score_batch_watched(reward_fn=_forks, timeout_s=5, heartbeat_s=None, children=children, **SAMPLES)
        time.sleep(0.3)  # let the shells start their sleeps
        left = _sleepers()
        assert len(left) == 6, left  # negative control: 2 calls x 3 sleepers outlive the calls
        assert children.reap(grace_s=2.0) >= 6
        assert _sleepers() == []
        assert before.poll() is None  # the older process is left alone
        assert children.reap() == 0  # idempotent
    finally:
        before.kill()
        before.wait()
        for pid in _sleepers():
            os.kill(pid, 9)
