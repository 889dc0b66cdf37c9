"""Calibrate the balancer's cost model on this hardware: ``python -m verl_balance.calibrate``.

Times forward + backward per micro-batch of ``b`` sequences of length ``L`` and fits by non-negative
least squares on relative error:

    seconds(micro-batch) = micro_batch + sequence * b + token * b L + pair * b L (L + 1) / 2

The JSON written is for ``balance.workload=calibrated balance.calibration_path=FILE``. ``--world N``
runs N gloo ranks under FSDP2, each time the max over ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from verl_balance.balance.workload import CALIBRATION_COEFFICIENTS, CalibratedWorkload
from verl_balance.batch_keys import ATTENTION_MASK_KEY, INPUT_IDS_KEY, LOSS_MASK_KEY, POSITION_IDS_KEY

FORMAT_VERSION = 1
BASE_TERMS = ("micro_batch", "token", "pair")
SEQUENCE_TERM_GAIN = 0.8  # keep the per-sequence term when it cuts the RMS relative error to <= 80%


class CalibrationError(ValueError):
    """A bad calibration request (grid, model, world size)."""


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """Micro-batches of ``batch`` sequences, each ``length`` tokens."""

    batch: int
    length: int

    def features(self) -> dict[str, float]:
        """The regressors of the cost model for this micro-batch."""
        b, length = float(self.batch), float(self.length)
        return {"micro_batch": 1.0, "sequence": b, "token": b * length, "pair": b * length * (length + 1.0) / 2.0}


def make_grid(*, sizes: list[int], lengths: list[int], max_tokens: int) -> list[GridPoint]:
    """Every (b, L) with b * L <= max_tokens."""
    grid = [GridPoint(b, n) for b in sizes for n in lengths if b * n <= max_tokens]
    if len({p.batch for p in grid}) < 2 or len({p.length for p in grid}) < 3:
        raise CalibrationError(
            f"grid sizes={sizes} x lengths={lengths} under max_tokens={max_tokens} leaves {len(grid)} points; "
            "valid: at least 2 micro-batch sizes and 3 lengths that fit (the fit has up to 4 terms)"
        )
    return grid


# ---------------------------------------------------------------------- fitting (numpy only)
def nnls(a: np.ndarray, b: np.ndarray, *, max_iter: int = 200) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max()) * float(np.abs(b).max()))
    for _ in range(max_iter):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max(initial=-np.inf) <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            shrinking = passive & (z <= 0)
            step = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def fit_terms(points: list[GridPoint], seconds: np.ndarray, terms: tuple[str, ...]) -> dict:
    """Non-negative fit of ``terms`` weighted by 1 / measured (relative error); coefficients and residuals."""
    features = np.array([[p.features()[t] for t in terms] for p in points])
    weights = 1.0 / seconds
    scale = features.max(axis=0)  # columns of comparable size for the solver
    x = nnls(features * weights[:, None] / scale, seconds * weights) / scale
    predicted = features @ x
    rel = (predicted - seconds) / seconds
    ss_tot = float(((seconds - seconds.mean()) ** 2).sum())
    return {
        "coefficients": {t: float(x[i]) for i, t in enumerate(terms)},
        "predicted": predicted,
        "r2": 1.0 - float(((predicted - seconds) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0,
        "max_rel_error": float(np.abs(rel).max()),
        "rms_rel_error": float(np.sqrt((rel**2).mean())),
    }


def fit_cost_model(points: list[GridPoint], seconds) -> dict:
    """The base fit (micro_batch, token, pair), or with the per-sequence term when it needs it."""
    seconds = np.asarray(seconds, dtype=np.float64)
    if (seconds <= 0).any() or not np.isfinite(seconds).all():
        raise CalibrationError(f"measured times must be finite and > 0; got {seconds.tolist()}")
    base = fit_terms(points, seconds, BASE_TERMS)
    full = fit_terms(points, seconds, BASE_TERMS + ("sequence",))
    chosen = full if full["rms_rel_error"] <= SEQUENCE_TERM_GAIN * base["rms_rel_error"] else base
    chosen["coefficients"] = {t: chosen["coefficients"].get(t, 0.0) for t in CALIBRATION_COEFFICIENTS}
    chosen["terms"] = [t for t in CALIBRATION_COEFFICIENTS if t in BASE_TERMS or chosen is full]
    chosen["alternatives"] = {
        "without_sequence": {k: base[k] for k in ("r2", "max_rel_error", "rms_rel_error")},
        "with_sequence": {k: full[k] for k in ("r2", "max_rel_error", "rms_rel_error")},
    }
    return chosen


# ---------------------------------------------------------------------- measuring
def _micro_batch(point: GridPoint, *, vocab_size: int, generator) -> dict:
    import torch

    ids = torch.randint(1, vocab_size, (point.batch, point.length), generator=generator)
    mask = torch.ones_like(ids)
    loss_mask = mask.clone()
    loss_mask[:, 0] = 0
    position_ids = torch.arange(point.length).expand(point.batch, -1).contiguous()
    return {INPUT_IDS_KEY: ids, ATTENTION_MASK_KEY: mask, LOSS_MASK_KEY: loss_mask, POSITION_IDS_KEY: position_ids}


def _measure_rank(rank: int, *, model_config, engine_config, world: int, grid, warmup: int, repeats: int, seed: int):
    """On one rank: busy seconds of every timed micro-batch per grid point (same order on every rank)."""
    import torch

    from verl_balance.distributed import ParallelLayout
    from verl_balance.engine.train_engine import TrainEngine

    layout = ParallelLayout(dp=world, sp=1, device_type="cuda" if torch.cuda.is_available() else "cpu")
    engine = TrainEngine(model_config=model_config, engine_config=engine_config, layout=layout)
    generator = torch.Generator().manual_seed(seed + rank)
    order = np.random.default_rng(seed).permutation(len(grid))  # same shuffled order on every rank
    engine.train_batch([_micro_batch(grid[0], vocab_size=model_config.vocab_size, generator=generator)] * 2)
    out = {}
    for i in order:
        mbs = [_micro_batch(grid[i], vocab_size=model_config.vocab_size, generator=generator)] * (warmup + repeats)
        out[int(i)] = list(engine.train_batch(mbs)["micro_batch_busy_seconds"][warmup:])
    return out


def measure(*, model_config, engine_config, world: int, grid, warmup: int, repeats: int, seed: int) -> np.ndarray:
    """Median over repeats of the max over ranks of each grid point's micro-batch busy seconds."""
    from verl_balance.distributed.launcher import run_on_ranks

    fn = functools.partial(
        _measure_rank,
        model_config=model_config,
        engine_config=engine_config,
        world=world,
        grid=grid,
        warmup=warmup,
        repeats=repeats,
        seed=seed,
    )
    per_rank = run_on_ranks(fn, world=world)
    return np.array([statistics.median(np.max([r[i] for r in per_rank], axis=0).tolist()) for i in range(len(grid))])


def fingerprint(*, model_name: str, model_config, engine_config, world: int) -> dict:
    """What the coefficients are valid for: hardware, software, model, dtype, kernel, layout."""
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "host": platform.node(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": model_name,
        "model_config": dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else {},
        "dtype": engine_config.param_dtype,
        "attn_impl": engine_config.attn_impl,
        "world_size": world,
        "fsdp": dataclasses.asdict(engine_config.fsdp),
    }


# ---------------------------------------------------------------------- CLI
def report_table(points: list[GridPoint], seconds: np.ndarray, fit: dict) -> str:
    """Predicted vs measured per grid point, then R^2 and the max relative error."""
    lines = [f"{'mbs':>4} {'len':>5} {'tokens':>7} {'measured ms':>12} {'predicted ms':>13} {'rel err':>8}"]
    for p, y, yhat in zip(points, seconds, fit["predicted"]):
        lines.append(
            f"{p.batch:>4} {p.length:>5} {p.batch * p.length:>7} {y * 1e3:>12.3f} {yhat * 1e3:>13.3f} "
            f"{(yhat - y) / y:>+8.3f}"
        )
    c = fit["coefficients"]
    lines.append(
        f"fit terms {fit['terms']}: micro_batch {c['micro_batch'] * 1e3:.3f} ms, "
        f"sequence {c['sequence'] * 1e6:.2f} us, token {c['token'] * 1e6:.3f} us, pair {c['pair'] * 1e9:.3f} ns"
    )
    alternatives = fit["alternatives"]
    lines.append(
        f"R^2 {fit['r2']:.4f}; max |relative error| {fit['max_rel_error']:.3f}; RMS relative error "
        f"{fit['rms_rel_error']:.3f} (without sequence term: {alternatives['without_sequence']['rms_rel_error']:.3f}"
        f", with: {alternatives['with_sequence']['rms_rel_error']:.3f})"
    )
    return "\n".join(lines)


def calibration_document(points, seconds, fit, fp, *, args) -> dict:
    """The JSON written by the CLI (read by ``CalibratedWorkload.from_file``)."""
    return {
        "format_version": FORMAT_VERSION,
        "coefficients": fit["coefficients"],
        "units": "seconds",
        "fingerprint": fp,
        "fit": {k: fit[k] for k in ("terms", "r2", "max_rel_error", "rms_rel_error", "alternatives")},
        "points": [
            {
                "micro_batch_size": p.batch,
                "length": p.length,
                "tokens": p.batch * p.length,
                "measured_s": float(y),
                "predicted_s": float(yhat),
            }
            for p, y, yhat in zip(points, seconds, fit["predicted"])
        ],
        "measurement": {"warmup": args.warmup, "repeats": args.repeats, "statistic": "median of max over ranks"},
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="ModelConfig preset (tiny, small, 100m)")
    parser.add_argument("--attn-impl", default="auto", help="attention kernel (EngineConfig.attn_impl)")
    parser.add_argument("--param-dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--world", type=int, default=1, help="ranks (FSDP2 over all of them when > 1)")
    parser.add_argument("--sizes", default="1,2,4,8", help="sequences per micro-batch, comma-separated")
    parser.add_argument("--lengths", default="8,32,96,288", help="sequence lengths, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=2304, help="skip grid points with more tokens")
    parser.add_argument("--warmup", type=int, default=2, help="untimed micro-batches per grid point")
    parser.add_argument("--repeats", type=int, default=5, help="timed micro-batches per grid point (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="calibration.json", help="JSON to write")
    args = parser.parse_args(argv)

    from verl_balance.engine.config import EngineConfig, OptimConfig
    from verl_balance.models import ModelConfig

    if args.world < 1 or args.warmup < 0 or args.repeats < 1:
        raise CalibrationError(
            f"--world {args.world}, --warmup {args.warmup}, --repeats {args.repeats}; valid: >=1, >=0, >=1"
        )
    grid = make_grid(
        sizes=[int(x) for x in args.sizes.split(",")],
        lengths=[int(x) for x in args.lengths.split(",")],
        max_tokens=args.max_tokens,
    )
    model_config = ModelConfig.preset(args.model)
    engine_config = EngineConfig(
        optim=OptimConfig(lr=1e-6), attn_impl=args.attn_impl, param_dtype=args.param_dtype, seed=args.seed
    )
    print(
        f"[calibrate] model={args.model} attn_impl={args.attn_impl} dtype={args.param_dtype} world={args.world}: "
        f"{len(grid)} grid points x ({args.warmup} warm-up + {args.repeats} timed) micro-batches; "
        f"load average {os.getloadavg()}",
        flush=True,
    )
    start = time.perf_counter()
    seconds = measure(
        model_config=model_config,
        engine_config=engine_config,
        world=args.world,
        grid=grid,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
    )
    fit = fit_cost_model(grid, seconds)
    fp = fingerprint(model_name=args.model, model_config=model_config, engine_config=engine_config, world=args.world)
    document = calibration_document(grid, seconds, fit, fp, args=args)
    CalibratedWorkload.from_dict(document)  # what the trainer will read back
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=1)
    print(report_table(grid, seconds, fit))
    print(
        f"[calibrate] wrote {args.out} in {time.perf_counter() - start:.0f} s; load average {os.getloadavg()}; "
        f"use: balance.workload=calibrated balance.calibration_path={os.path.abspath(args.out)}",
        flush=True,
    )
    return document


if __name__ == "__main__":
    try:
        main()
    except CalibrationError as err:
        sys.exit(f"error: {err}")
