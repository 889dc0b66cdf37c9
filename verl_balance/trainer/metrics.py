"""Driver-side metrics: per-rank engine results reduced to global figures, and a plan's
predicted balance."""

from __future__ import annotations

import numpy as np

PEAK_MEMORY_KEY = "perf/max_memory_allocated_gb"
# The engine's throughput figures (engine/perf.py), logged under their own names: the driver's
# perf/tokens and perf/tokens_per_s (whole driver step) are different figures and keep theirs.
ENGINE_PERF_KEYS = ("perf/mfu", "perf/tokens_per_s_per_device", PEAK_MEMORY_KEY)


def reduce_rank_metrics(per_rank: list[dict], *, prefix: str) -> dict:
    """Driver-side view of one engine call: global figures and measured per-rank timing.

    Engine metrics (loss, grad_norm) are already global, so DP rank 0's is taken, under ``prefix``;
    per-rank compute time gives the measured imbalance. ENGINE_PERF_KEYS keep their names (peak memory:
    the maximum over ranks)."""
    out = {}
    for key, value in per_rank[0].items():
        if key in ENGINE_PERF_KEYS:
            out[key] = float(value)
        elif isinstance(value, (int, float, bool)) and key != "dp_rank" and not key.endswith("seconds"):
            out[prefix + key] = float(value)
    peak_memory = [m[PEAK_MEMORY_KEY] for m in per_rank if PEAK_MEMORY_KEY in m]
    if peak_memory:
        out[PEAK_MEMORY_KEY] = float(max(peak_memory))
    out.update(measured_balance_metrics(busy_seconds(per_rank)))
    return out


def busy_seconds(per_rank: list[dict]) -> np.ndarray:
    """Each rank's busy seconds of one engine call: its compute, not its waits in collectives."""
    return np.array([m.get("busy_seconds", 0.0) for m in per_rank], dtype=np.float64)


def measured_balance_metrics(busy: np.ndarray) -> dict:
    """``balance/imbalance_measured`` (max / mean of per-rank busy seconds) and ``timing_s/busy_max|mean``;
    nothing when no rank was busy."""
    if not busy.size or busy.mean() <= 0:
        return {}
    return {
        "balance/imbalance_measured": float(busy.max() / busy.mean()),
        "timing_s/busy_max": float(busy.max()),
        "timing_s/busy_mean": float(busy.mean()),
    }


def plan_metrics(plan) -> dict:
    """Predicted balance of the plan and of the naive contiguous split, from the plan's stats."""
    s = plan.stats
    out = {
        "balance/imbalance_predicted": float(s["imbalance"]),
        "balance/imbalance_predicted_naive": float(s["naive_imbalance"]),
        "balance/sync_ratio_predicted": float(s["sync_ratio"]),
        "balance/sync_ratio_predicted_naive": float(s["naive_sync_ratio"]),
        "balance/num_micro_batches": float(s["num_micro_batches"]),
        "balance/num_micro_batches_naive": float(s["naive_num_micro_batches"]),
    }
    if s.get("num_skipped") or s.get("num_truncated"):
        out["balance/skipped"] = float(s["num_skipped"])
        out["balance/truncated"] = float(s["num_truncated"])
    return out


# ---------------------------------------------------------------------- GRPO/PPO names (verl's)
# verl's names (verl/trainer/ppo/metric_utils.py compute_data_metrics, compute_timing_metrics,
# compute_throughout_metrics; ray_trainer.py _val_metrics_update), so a verl dashboard reads our
# runs unchanged. Names of figures verl does not log stay ours (docs/metrics.md lists both).
SCORE_PREFIX = "critic/score/"
"""The sequence scores (the reward function's output), verl's ``critic/score/{mean,max,min}``."""
SCORE_MEAN_KEY = SCORE_PREFIX + "mean"
REWARDS_PREFIX = "critic/rewards/"
"""The sequence rewards (scores minus the KL-in-reward penalty), verl's ``critic/rewards/*``."""
ADVANTAGES_PREFIX = "critic/advantages/"
RETURNS_PREFIX = "critic/returns/"
RESPONSE_LENGTH_PREFIX = "response_length/"
RESPONSE_LENGTH_MEAN_KEY = RESPONSE_LENGTH_PREFIX + "mean"
PROMPT_LENGTH_PREFIX = "prompt_length/"
EPOCH_KEY = "training/epoch"
ROLLOUT_PROBS_DIFF_PREFIX = "training/rollout_probs_diff_"
KL_LOSS_KEY = "actor/kl_loss"
TOTAL_TOKENS_KEY = "perf/total_num_tokens"
TIME_PER_STEP_KEY = "perf/time_per_step"
THROUGHPUT_KEY = "perf/throughput"
"""Tokens per second per device (verl's ``perf/throughput``: total tokens / (step seconds x devices))."""
TOKENS_PER_S_KEY = "perf/tokens_per_s"
"""Ours (verl has none): tokens per second of the whole step over all devices (SFT and GRPO/PPO)."""
SFT_TOKENS_KEY = "train/global_tokens"
"""verl's SFT name: the non-padding tokens of the step's global mini-batch."""
# Ours: figures verl does not log.
SCORE_STD_KEY = "reward/std"
ACCURACY_KEY = "reward/accuracy"
"""The mean of the reward's ``acc`` (the mean score when it returns none)."""
VAL_ACC_KEY = "val/acc"
"""The held-out ``acc`` over all data sources (verl logs per source only: ``val-core/<source>/acc/mean@N``)."""
VAL_REWARD_KEY = "val/reward_mean"
"""The held-out mean score over all data sources (per source: ``val-core/<source>/reward/mean@N``)."""
TIMING_PREFIX = "timing_s/"
# verl's timing_raw names (ray_trainer.py marked_timer) of the GRPO/PPO step's phases (the values
# pass is timed as batch_keys.VALUES_KEY, verl's "values").
TIMING_GEN, TIMING_REWARD, TIMING_OLD_LOG_PROB, TIMING_REF = "gen", "reward", "old_log_prob", "ref"
TIMING_ADV, TIMING_UPDATE_CRITIC, TIMING_UPDATE_ACTOR = "adv", "update_critic", "update_actor"
TIMING_STEP, TIMING_VALIDATE, TIMING_GEN_MAX = "step", "testing", "gen_max"


def timing_key(phase: str) -> str:
    """``timing_s/<phase>``: seconds of one phase of the step (verl's ``compute_timing_metrics``)."""
    return TIMING_PREFIX + phase


def _stats(prefix: str, values: np.ndarray, *, stats: tuple[str, ...] = ("mean", "max", "min")) -> dict:
    values = np.asarray(values, dtype=np.float64)
    if not values.size:
        return {prefix + s: float("nan") for s in stats}  # verl's value when nothing is left to average
    return {prefix + s: float(getattr(np, s)(values)) for s in stats}


def rollout_data_metrics(
    *,
    scores: np.ndarray,
    extras: dict,
    response_lengths: np.ndarray,
    finish_reasons: np.ndarray,
    prompt_lengths: np.ndarray,
    max_prompt_length: int,
) -> dict:
    """verl's data metrics of one rollout batch (``critic/score/*``, ``response_length/*``,
    ``prompt_length/*``) plus ours: ``reward/std``, ``reward/accuracy`` and ``reward/<extra>``."""
    scores = np.asarray(scores, dtype=np.float64)
    prompt_lengths = np.asarray(prompt_lengths, dtype=np.float64)
    out = {
        **_stats(SCORE_PREFIX, scores),
        SCORE_STD_KEY: float(scores.std()),
        ACCURACY_KEY: float(np.nanmean(extras["acc"] if "acc" in extras else scores)),
        **_stats(RESPONSE_LENGTH_PREFIX, response_lengths),
        RESPONSE_LENGTH_PREFIX + "clip_ratio": float(np.mean(np.asarray(finish_reasons) == "length")),
        **_stats(PROMPT_LENGTH_PREFIX, prompt_lengths),
        PROMPT_LENGTH_PREFIX + "clip_ratio": float(np.mean(prompt_lengths >= max_prompt_length)),
    }
    for key, values in extras.items():
        if key != "acc" and np.isfinite(values).any():
            out[f"reward/{key}"] = float(np.nanmean(values))
    return out


def advantage_data_metrics(*, rewards: np.ndarray, advantages: np.ndarray, mask: np.ndarray) -> dict:
    """verl's ``critic/rewards/*`` (per sequence) and ``critic/advantages/*`` (per loss-mask token); (B, L) arrays."""
    mask = np.asarray(mask).astype(bool)
    return {
        **_stats(REWARDS_PREFIX, np.asarray(rewards, dtype=np.float64).sum(-1)),
        **_stats(ADVANTAGES_PREFIX, np.asarray(advantages, dtype=np.float64)[mask]),
    }


def throughput_metrics(*, tokens: int, step_seconds: float, num_devices: int) -> dict:
    """verl's ``perf/total_num_tokens``, ``time_per_step``, ``throughput`` (per device); our ``perf/tokens_per_s``."""
    return {
        TOTAL_TOKENS_KEY: float(tokens),
        TIME_PER_STEP_KEY: float(step_seconds),
        THROUGHPUT_KEY: tokens / (step_seconds * num_devices),
        TOKENS_PER_S_KEY: tokens / step_seconds,
    }


def validation_metrics(
    *, scores: np.ndarray, extras: dict, sources: np.ndarray, uids: np.ndarray, response_lengths: np.ndarray
) -> dict:
    """Held-out metrics named as verl's ``_val_metrics_update`` names them, per data source:
    ``val-core/<source>/<acc or reward>/mean@N``, other variables under ``val-aux/<source>/<var>/mean@N``
    (and ``std@N`` with N > 1); N = responses per prompt. Ours, over all sources: ``val/reward_mean``,
    ``val/acc`` (when returned), ``val/response_length/{mean,max,min}``."""
    variables = {"reward": np.asarray(scores, dtype=np.float64)}
    variables.update({k: np.asarray(v, dtype=np.float64) for k, v in extras.items() if np.isfinite(v).any()})
    core = "acc" if "acc" in variables else "reward"
    sources, uids = np.asarray(sources), np.asarray(uids)
    out = {
        VAL_REWARD_KEY: float(variables["reward"].mean()),
        **_stats("val/" + RESPONSE_LENGTH_PREFIX, response_lengths),
    }
    if core == "acc":
        out[VAL_ACC_KEY] = float(np.nanmean(variables["acc"]))
    for source in sorted(set(sources.tolist())):
        rows = sources == source
        groups = [rows & (uids == uid) for uid in dict.fromkeys(uids[rows].tolist())]
        n = max(int(g.sum()) for g in groups)
        for name, values in variables.items():
            section = "val-core" if name == core else "val-aux"
            out[f"{section}/{source}/{name}/mean@{n}"] = float(np.mean([np.nanmean(values[g]) for g in groups]))
            if n > 1:
                out[f"val-aux/{source}/{name}/std@{n}"] = float(np.mean([np.nanstd(values[g]) for g in groups]))
    return out
