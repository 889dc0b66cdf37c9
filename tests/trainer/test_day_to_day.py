"""Day-to-day use (issue 29): the progress line with an ETA, the run log as the whole console, short
user errors with a "did you mean" and exit code 2."""

from __future__ import annotations

import io
import json
import logging
import re
import subprocess
import sys

import pytest

from tests.trainer.conftest import run_cli_in_process
from verl_balance.trainer.config.checks import ConfigError, did_you_mean
from verl_balance.trainer.config.cli import check_overrides, user_errors
from verl_balance.trainer.config.sft import SFTConfig
from verl_balance.utils import run_log
from verl_balance.utils.progress import ProgressDisplay, format_eta


# ---------------------------------------------------------------------- progress display
class _Pipe(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_plain_progress_line_has_total_rate_eta_and_chosen_keys(monkeypatch):
    now = [100.0]
    out = _Pipe()
    monkeypatch.setattr(sys, "stdout", out)
    progress = ProgressDisplay(total_steps=10, keys=("train/loss", "val/loss"), stream=out, clock=lambda: now[0])
    now[0] = 102.0
    progress.update(1, {"train/loss": 2.5, "perf/tokens_per_s": 1500.0, "balance/imbalance_measured": 1.1})
    now[0] = 104.0
    progress.update(2, {"train/loss": 2.25, "val/loss": 2.75, "perf/tokens_per_s": 999.0})
    lines = out.getvalue().splitlines()
    # 2 s per step (the fake clock), 8 steps left: 16 s.
    assert lines == [
        "step 1/10 | 2 s/step | 1.5k tok/s | ETA 0:00:18 | train/loss 2.5",
        "step 2/10 | 2 s/step | 999 tok/s | ETA 0:00:16 | train/loss 2.25 | val/loss 2.75",
    ]
    assert "\r" not in out.getvalue()
    assert "balance/" not in out.getvalue(), "only the chosen keys reach the console"


def test_plain_progress_respects_interval_and_prints_the_last_step(monkeypatch):
    now = [0.0]
    out = _Pipe()
    monkeypatch.setattr(sys, "stdout", out)
    progress = ProgressDisplay(total_steps=5, keys=(), interval_s=10.0, stream=out, clock=lambda: now[0])
    for step in range(1, 6):
        now[0] = 3.0 * step
        progress.update(step, {})
    printed = [int(m) for m in re.findall(r"^step (\d)/5", out.getvalue(), flags=re.M)]
    assert printed == [1, 5], "step 1 (first), nothing within 10 s, then the last step"


def test_resumed_run_counts_rate_from_its_own_first_step(monkeypatch):
    now = [0.0]
    out = _Pipe()
    monkeypatch.setattr(sys, "stdout", out)
    progress = ProgressDisplay(total_steps=10, start_step=6, keys=(), stream=out, clock=lambda: now[0])
    now[0] = 4.0
    progress.update(8, {})  # two steps of this process in 4 s, two left
    assert out.getvalue() == "step 8/10 | 2 s/step | ETA 0:00:04\n"
    assert format_eta(3725.4) == "1:02:05"


# ---------------------------------------------------------------------- run log
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True

    def screen(self) -> list[str]:
        """The lines a terminal shows for what was written: ``\\r`` returns to column 0 and overwrites."""
        lines, line, col = [], [], 0
        for ch in self.getvalue():
            if ch == "\n":
                lines.append("".join(line).rstrip())
                line, col = [], 0
            elif ch == "\r":
                col = 0
            else:
                line[col : col + 1] = [ch]
                col += 1
        return lines + ["".join(line).rstrip()]


@pytest.mark.parametrize("bar_known", [True, False])
def test_lines_written_while_the_bar_is_shown_go_above_it(tmp_path, monkeypatch, bar_known):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr("verl_balance.utils.progress._terminal_columns", lambda stream: 60)
    with run_log.capture():
        run_log.attach(str(tmp_path / "main_x.log"))
        progress = ProgressDisplay(total_steps=3, keys=(), stream=terminal, is_terminal=True)
        if not bar_known:
            run_log.show_bar(None)  # negative control: the tee does not know of the bar
        progress.update(1, {})
        print("a log line written mid-run")
        progress.update(2, {})
        shown = terminal.screen()
        progress.close()
    if bar_known:
        assert shown[0] == "a log line written mid-run" and shown[-1].startswith("train "), shown
    else:  # the line continues the bar's
        assert shown[0].startswith("train ") and shown[0].endswith("/sa log line written mid-run"), shown


def test_run_log_tees_prints_log_records_and_buffered_lines(tmp_path, monkeypatch):
    console = _Pipe()
    monkeypatch.setattr(sys, "stdout", console)
    handler = logging.StreamHandler(console)
    log = logging.getLogger("dayuse_test")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with run_log.capture():
            print("before the run directory is known")
            opened = run_log.attach(str(tmp_path / "main_x.log"))
            assert not opened.owned_by_driver
            log.info("a log record")
            run_log.write_log_only("a line for the log only\n")
            print("\x1b[36m(ActorWorker rank=1 pid=7)\x1b[0m a worker line")
            print("the summary")
        print("after the run")
    finally:
        log.removeHandler(handler)
    text = (tmp_path / "main_x.log").read_text()
    assert text == (
        "before the run directory is known\na log record\na line for the log only\n"
        "(ActorWorker rank=1 pid=7) a worker line\nthe summary\n"
    )
    assert console.getvalue() == (
        "before the run directory is known\na log record\n\x1b[36m(ActorWorker rank=1 pid=7)\x1b[0m a worker line\n"
        "the summary\nafter the run\n"
    )
    assert handler.stream is console, "the handler's stream is restored"


# ---------------------------------------------------------------------- short user errors
def test_did_you_mean_finds_near_keys_and_keys_of_other_sections():
    keys = ["trainer.total_epochs", "trainer.logger", "optim.lr", "data.train_batch_size"]
    assert did_you_mean("trainer.total_epoch", keys) == " (did you mean 'trainer.total_epochs'?)"
    assert "'optim.lr'" in did_you_mean("trainer.lr", keys)
    assert did_you_mean("trainer.zzzzzz", keys) == "", "negative control: nothing near"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.total_epoch=2", "did you mean 'trainer.total_epochs'?"),
        ("+trainer.total_epoch=2", "did you mean 'trainer.total_epochs'?"),
        ("+trainer.total_epochs=2", "'+' appends a new key: write trainer.total_epochs=2"),
    ],
)
def test_override_typos_exit_2_with_one_message(override, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        check_overrides([override], schema=SFTConfig)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1


def test_valid_overrides_pass_the_check():
    check_overrides(
        ["trainer.total_epochs=2", "+hydra.job.name=x", "custom_reward_function.reward_kwargs.k=1"]
        if hasattr(SFTConfig, "custom_reward_function")
        else ["trainer.total_epochs=2", "hydra.run.dir=x", "optim.lr=1e-3"],
        schema=SFTConfig,
    )


def test_user_errors_exit_2_and_bugs_keep_their_traceback(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_info, user_errors():
        raise ConfigError("balance.workload='flop' is not valid")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: balance.workload='flop' is not valid\n"
    with pytest.raises(KeyError), user_errors():
        raise KeyError("a bug")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError), user_errors():
        raise ConfigError("shown with its traceback")


@pytest.mark.slow
def test_cli_typo_and_bad_value_are_one_line_exit_2(monkeypatch, capsys):
    """The typo through a real ``python -m`` (the interpreter's own exit code and stderr); the bad value
    through the same entry point in this process (run_cli_in_process), one interpreter start less."""
    proc = subprocess.run(
        [sys.executable, "-m", "verl_balance.main_sft", "trainer.total_epoch=2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    bad_value = run_cli_in_process(
        "verl_balance.main_sft", ["balance.workload=flop"], monkeypatch=monkeypatch, capsys=capsys
    )
    for (code, stderr), expected in [
        ((proc.returncode, proc.stderr), "did you mean 'trainer.total_epochs'?"),
        (bad_value, "did you mean 'flops'?"),
    ]:
        assert code == 2, stderr
        assert expected in stderr
        assert "Traceback" not in stderr and "HYDRA_FULL_ERROR" not in stderr


@pytest.mark.slow
def test_default_cli_run_shows_eta_and_its_log_is_the_whole_console(cli_sft_run):
    proc, run_dir = cli_sft_run["proc"], cli_sft_run["run_dir"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_lines = re.findall(r"^step (\d+)/(\d+) \|.*\| ETA \d+:\d\d:\d\d \|.*train/loss", proc.stdout, flags=re.M)
    assert [int(s) for s, _ in step_lines] == sorted(set(steps)) == [1, 2, 3, 4]
    assert {int(total) for _, total in step_lines} == {4}
    assert "Token authentication" not in proc.stderr
    log = (run_dir / "main_sft.log").read_text()
    for line in proc.stdout.splitlines() + proc.stderr.splitlines():
        assert line in log, f"console line missing from the run log: {line!r}"
    assert "==== SFT summary ====" in log and "model load (" in log and "cluster (" in log
    assert "\r" not in log


# ---------------------------------------------------------------------- verl's logger names
def test_verl_logger_names_file_and_mlflow_and_others_refused_with_the_list(tmp_path, monkeypatch, caplog):
    import importlib.util

    from verl_balance.trainer.config.sections import TrainerSection
    from verl_balance.trainer.driver import tracking_backends
    from verl_balance.utils import tracking

    TrainerSection(logger=["console", "file", "mlflow"])
    with pytest.raises(ConfigError, match=r"logger='swanlab' is not valid.*'file'.*'mlflow'"):
        TrainerSection(logger=["swanlab"])
    assert tracking_backends(["console", "file", "jsonl", "mlflow"]) == ["jsonl", "mlflow"]
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real_find_spec(name, *a)
    )
    with caplog.at_level(logging.WARNING, logger="verl_balance.utils.tracking"):
        tracker = tracking.Tracking("p", "e", log_dir=str(tmp_path), backends=["jsonl", "mlflow"])
    assert "mlflow package is not installed" in caplog.text
    tracker.log({"train/loss": 1.0}, step=1)
    tracker.close()
    assert tracking.read_metrics(str(tmp_path))[0]["train/loss"] == 1.0


# ---------------------------------------------------------------------- plot labels
def test_plot_labels_are_run_directory_names_even_with_the_same_experiment(tmp_path):
    from verl_balance.utils.plotting import run_labels

    runs = []
    for name in ("runA", "runB"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"experiment": "sft"}))
        runs.append(str(tmp_path / name))
    assert run_labels(runs) == ["runA", "runB"]
    assert run_labels([str(tmp_path / "x" / "run" / "metrics.jsonl"), str(tmp_path / "y" / "run")]) == [
        "x/run",
        "y/run",
    ]


def test_worker_repr_names_the_rank_ray_prefixes_its_lines_with(monkeypatch):
    from verl_balance.single_controller.worker import Worker
    from verl_balance.workers.actor import ActorWorker

    monkeypatch.setenv("RANK", "3")
    assert repr(Worker()) == "Worker rank=3"
    assert ActorWorker.__repr__ is Worker.__repr__


def test_rl_progress_line_shows_the_phases_of_the_step():
    out = _Pipe()
    progress = ProgressDisplay(total_steps=2, keys=("critic/score/mean",), stream=out, clock=lambda: 0.0)
    metrics = {
        "timing_s/gen": 1.25,
        "timing_s/old_log_prob": 0.5,
        "timing_s/update_actor": 2.0,
        "critic/score/mean": 0.5,
    }
    assert progress.line(1, metrics) == "step 1/2 | rollout 1.2 s, log-prob 0.5 s, update 2 s | critic/score/mean 0.5"
