"""Tracking writes metrics.jsonl (always), handles optional backends, and plots runs to PNG."""

import importlib.util
import json
import logging

import numpy as np
import pytest
import torch

from verl_balance.utils import plotting, tracking
from verl_balance.utils.tracking import Tracking, TrackingError, read_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_run(log_dir, *, experiment, losses, backends=("jsonl",)):
    with Tracking("proj", experiment, log_dir=str(log_dir), backends=backends) as tracker:
        for step, loss in enumerate(losses, start=1):
            tracker.log(
                {
                    "train/loss": loss,
                    "balance/imbalance_predicted": 1.05,
                    "balance/imbalance_predicted_naive": 1.6,
                    "balance/imbalance_measured": 1.1 + 0.01 * step,
                },
                step=step,
            )
            if step % 2 == 0:
                tracker.log({"val/loss": loss + 0.1}, step=step)
    return str(log_dir)


def test_jsonl_records_every_step_with_plain_numbers(tmp_path, capsys):
    with Tracking("p", "e", log_dir=str(tmp_path), backends=["console"]) as tracker:
        tracker.log({"train/loss": torch.tensor(2.5), "train/valid_tokens": np.int64(7), "note": "x"}, step=1)
        tracker.log({"train/loss": 2.25}, step=2)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in lines] == [(1, 2.5), (2, 2.25)]
    assert lines[0]["train/valid_tokens"] == 7 and lines[0]["note"] == "x"
    assert json.loads((tmp_path / "run.json").read_text())["experiment"] == "e"
    assert "step 2 | train/loss 2.25" in capsys.readouterr().out


def test_resumed_run_appends_and_reads_back_one_merged_record_per_step(tmp_path):
    _fake_run(tmp_path, experiment="e", losses=[3.0, 2.0, 1.5])
    with Tracking("proj", "e", log_dir=str(tmp_path), backends=[]) as tracker:  # resume from step 2
        tracker.log({"train/loss": 1.9}, step=3)
        tracker.log({"train/loss": 1.2}, step=4)
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in records] == [3.0, 2.0, 1.9, 1.2]
    assert records[1]["val/loss"] == pytest.approx(2.1)


def test_bad_backend_and_bad_metric_are_named(tmp_path):
    with pytest.raises(TrackingError, match=r"\['swanlab'\].*console"):
        Tracking("p", "e", log_dir=str(tmp_path), backends=["swanlab"])
    with Tracking("p", "e", log_dir=str(tmp_path), backends=[]) as tracker:
        with pytest.raises(TrackingError, match="'train/loss'"):
            tracker.log({"train/loss": [1.0, 2.0]}, step=1)


def test_missing_optional_backends_warn_and_jsonl_still_works(tmp_path, monkeypatch, caplog):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        tracking.importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("tensorboard", "wandb") else real_find_spec(name, *a),
    )
    with caplog.at_level(logging.WARNING, logger="verl_balance.utils.tracking"):
        tracker = Tracking("p", "e", log_dir=str(tmp_path), backends=["tensorboard", "wandb"])
    assert "tensorboard package is not installed" in caplog.text
    assert "wandb package is not installed" in caplog.text
    tracker.log({"train/loss": 1.0}, step=1)
    tracker.close()
    assert read_metrics(str(tmp_path))[0]["train/loss"] == 1.0


def test_plot_overlays_runs_into_a_png(tmp_path):
    runs = [_fake_run(tmp_path / name, experiment=name, losses=[3.0, 2.0, 1.5, 1.2]) for name in ("dp4", "dp2sp2")]
    out = plotting.plot_runs(runs, out=str(tmp_path / "fig" / "curves.png"))
    data = open(out, "rb").read()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plot_cli_defaults_to_the_first_run_dir(tmp_path, capsys):
    run = _fake_run(tmp_path / "run", experiment="run", losses=[3.0, 2.0])
    plotting.main([run, "--keys", "imbalance_measured"])
    assert (tmp_path / "run" / "curves.png").read_bytes().startswith(PNG_MAGIC)
    assert capsys.readouterr().out.strip().endswith("curves.png")


def test_plot_without_matching_metrics_names_what_it_found(tmp_path):
    with Tracking("p", "e", log_dir=str(tmp_path), backends=[]) as tracker:
        tracker.log({"timing_s/gen": 1.0}, step=1)
    with pytest.raises(ValueError, match=r"timing_s/gen"):
        plotting.plot_runs([str(tmp_path)], out=str(tmp_path / "x.png"))
