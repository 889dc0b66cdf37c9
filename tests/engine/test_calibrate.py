"""verl_balance.calibrate: the NNLS fit against independent references, and the CLI end to end."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from verl_balance.balance.workload import CalibratedWorkload
from verl_balance.calibrate import CalibrationError, GridPoint, fit_cost_model, main, make_grid, nnls


def _brute_force_nnls(a, b):
    """Best least-squares solution over every support set whose unconstrained solution is >= 0."""
    best, best_x = np.inf, np.zeros(a.shape[1])
    for k in range(a.shape[1] + 1):
        for support in itertools.combinations(range(a.shape[1]), k):
            x = np.zeros(a.shape[1])
            if support:
                x[list(support)] = np.linalg.lstsq(a[:, list(support)], b, rcond=None)[0]
            if (x >= -1e-12).all():
                residual = float(np.linalg.norm(a @ x - b))
                if residual < best - 1e-12:
                    best, best_x = residual, x
    return best_x


@pytest.mark.parametrize("seed", range(12))
def test_nnls_matches_brute_force_over_support_sets(seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(10, 4))
    b = rng.normal(size=10)
    x = nnls(a, b)
    assert (x >= 0).all()
    np.testing.assert_allclose(np.linalg.norm(a @ x - b), np.linalg.norm(a @ _brute_force_nnls(a, b) - b), rtol=1e-9)


GRID = make_grid(sizes=[1, 2, 4, 8], lengths=[8, 32, 96, 288], max_tokens=2304)


def _seconds(c0, seq, tok, pair):
    return np.array(
        [c0 + seq * p.batch + tok * p.batch * p.length + pair * p.batch * p.length * (p.length + 1) / 2 for p in GRID]
    )


def test_fit_recovers_exact_coefficients_and_keeps_the_sequence_term_when_needed():
    fit = fit_cost_model(GRID, _seconds(5.5e-3, 4e-4, 2e-5, 3e-9))
    assert fit["terms"] == ["micro_batch", "sequence", "token", "pair"]
    np.testing.assert_allclose(
        [fit["coefficients"][k] for k in ("micro_batch", "sequence", "token", "pair")],
        [5.5e-3, 4e-4, 2e-5, 3e-9],
        rtol=1e-6,
    )
    assert fit["r2"] == pytest.approx(1.0) and fit["max_rel_error"] < 1e-6


def test_fit_drops_the_sequence_term_when_the_data_has_none():
    fit = fit_cost_model(GRID, _seconds(5.5e-3, 0.0, 2e-5, 3e-9))
    assert fit["terms"] == ["micro_batch", "token", "pair"] and fit["coefficients"]["sequence"] == 0.0
    assert fit["coefficients"]["micro_batch"] == pytest.approx(5.5e-3, rel=1e-6)


def test_fit_never_returns_a_negative_coefficient():
    # A decreasing cost per token pushes least squares negative; NNLS clips it to 0 and refits.
    seconds = _seconds(5e-3, 0.0, 1e-5, 0.0) - np.array([1e-7 * p.batch * p.length for p in GRID])
    fit = fit_cost_model(GRID, np.maximum(seconds, 1e-6))
    assert all(v >= 0 for v in fit["coefficients"].values())


def test_bad_grid_or_times_raise():
    with pytest.raises(CalibrationError, match="at least 2 micro-batch sizes and 3 lengths"):
        make_grid(sizes=[1], lengths=[8, 16, 32], max_tokens=100)
    with pytest.raises(CalibrationError, match="finite and > 0"):
        fit_cost_model(GRID, np.zeros(len(GRID)))
    assert GridPoint(2, 10).features() == {"micro_batch": 1.0, "sequence": 2.0, "token": 20.0, "pair": 110.0}


@pytest.mark.slow
def test_cli_writes_a_calibration_the_balancer_reads(tmp_path, capsys):
    out = tmp_path / "cal.json"
    doc = main(
        [
            "--model",
            "tiny",
            "--sizes",
            "1,4",
            "--lengths",
            "8,32,64",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ]
    )
    workload = CalibratedWorkload.from_file(str(out))
    assert workload.fingerprint["model"] == "tiny" and workload.fingerprint["world_size"] == 1
    saved = json.loads(out.read_text())
    assert len(saved["points"]) == 6 and saved["coefficients"] == doc["coefficients"]
    assert all(p["measured_s"] > 0 for p in saved["points"])
    printed = capsys.readouterr().out
    assert "R^2" in printed and "max |relative error|" in printed
