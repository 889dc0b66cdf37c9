"""GRPO/PPO metrics under verl's names and with verl's values (trainer/metrics.py).

The reference is verl 0.9.1's own code where it is installed (``compute_data_metrics``,
``compute_throughout_metrics``, ``process_validation_metrics`` with ``_val_metrics_update``'s
naming), and hand-worked values everywhere (so the fast lane of a machine without verl still
checks the names). That ``main_grpo``'s step records carry these names end to end is checked on verl's
own launch scripts in tests/trainer/test_verl_launch_scripts.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._verl import VERL_SKIP_REASON
from verl_balance.trainer.metrics import (
    advantage_data_metrics,
    rollout_data_metrics,
    throughput_metrics,
    validation_metrics,
)
from verl_balance.utils.progress import DEFAULT_RL_KEYS, PHASE_TIMINGS

# One batch of 4 responses: prompt lengths (max_prompt_length 5), response lengths (max 4).
PROMPT_LENGTHS = np.array([3, 5, 2, 5])
RESPONSE_LENGTHS = np.array([4, 1, 2, 4])
FINISH = np.array(["length", "stop", "stop", "length"])  # a response stopped by the limit has length 4
SCORES = np.array([1.0, 0.0, 0.5, 0.25])
MAX_PROMPT, MAX_RESPONSE = 5, 4


def _token_tensors(seed: int = 0) -> dict:
    """(B, L) token rewards (the score on the last response token minus a KL term), advantages and the mask."""
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(MAX_RESPONSE)[None, :] < torch.from_numpy(RESPONSE_LENGTHS)[:, None]).float()
    rewards = -0.01 * torch.rand(4, MAX_RESPONSE, generator=gen) * mask
    rewards[torch.arange(4), torch.from_numpy(RESPONSE_LENGTHS) - 1] += torch.from_numpy(SCORES).float()
    advantages = torch.randn(4, MAX_RESPONSE, generator=gen) * mask
    return {"rewards": rewards, "advantages": advantages, "mask": mask}


def test_rollout_data_metrics_hand_worked():
    out = rollout_data_metrics(
        scores=SCORES,
        extras={"acc": np.array([1.0, 0.0, 1.0, 0.0]), "format_ok": np.array([1.0, np.nan, 0.0, 1.0])},
        response_lengths=RESPONSE_LENGTHS,
        finish_reasons=FINISH,
        prompt_lengths=PROMPT_LENGTHS,
        max_prompt_length=MAX_PROMPT,
    )
    assert out == {
        "critic/score/mean": 0.4375,
        "critic/score/max": 1.0,
        "critic/score/min": 0.0,
        "reward/std": pytest.approx(np.std(SCORES)),
        "reward/accuracy": 0.5,
        "reward/format_ok": pytest.approx(2 / 3),
        "response_length/mean": 2.75,
        "response_length/max": 4.0,
        "response_length/min": 1.0,
        "response_length/clip_ratio": 0.5,
        "prompt_length/mean": 3.75,
        "prompt_length/max": 5.0,
        "prompt_length/min": 2.0,
        "prompt_length/clip_ratio": 0.5,
    }


def test_advantage_data_metrics_sum_rewards_per_sequence_and_mask_advantages():
    t = _token_tensors()
    out = advantage_data_metrics(rewards=t["rewards"], advantages=t["advantages"], mask=t["mask"])
    sequence = t["rewards"].sum(-1).double()
    valid = t["advantages"][t["mask"].bool()].double()
    assert out["critic/rewards/mean"] == pytest.approx(float(sequence.mean()))
    assert out["critic/rewards/min"] == pytest.approx(float(sequence.min()))
    assert out["critic/advantages/max"] == pytest.approx(float(valid.max()))
    assert out["critic/advantages/mean"] == pytest.approx(float(valid.mean()))
    # Negative control: the padding zeros would move the mean if they were counted.
    assert out["critic/advantages/mean"] != pytest.approx(float(t["advantages"].double().mean()))


def test_data_and_throughput_metrics_equal_verls_own():
    pytest.importorskip("verl", reason=VERL_SKIP_REASON)
    from verl import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_throughout_metrics

    t = _token_tensors(seed=3)
    prompt_mask = (torch.arange(MAX_PROMPT)[None, :] >= MAX_PROMPT - torch.from_numpy(PROMPT_LENGTHS)[:, None]).long()
    attention = torch.cat([prompt_mask, t["mask"].long()], dim=1)
    scores = torch.zeros(4, MAX_RESPONSE)
    scores[torch.arange(4), torch.from_numpy(RESPONSE_LENGTHS) - 1] = torch.from_numpy(SCORES).float()
    batch = DataProto.from_dict(
        tensors={
            "token_level_scores": scores,
            "token_level_rewards": t["rewards"],
            "advantages": t["advantages"],
            "returns": t["advantages"],
            "prompts": torch.zeros(4, MAX_PROMPT, dtype=torch.long),
            "responses": torch.zeros(4, MAX_RESPONSE, dtype=torch.long),
            "response_mask": t["mask"].long(),
            "attention_mask": attention,
        },
        meta_info={"global_token_num": attention.sum(-1).tolist()},
    )
    verl = compute_data_metrics(batch=batch, use_critic=False)
    ours = {
        **rollout_data_metrics(
            scores=SCORES,
            extras={},
            response_lengths=RESPONSE_LENGTHS,
            finish_reasons=FINISH,
            prompt_lengths=PROMPT_LENGTHS,
            max_prompt_length=MAX_PROMPT,
        ),
        **advantage_data_metrics(**t),
    }
    shared = {k for k in ours if k in verl}
    assert len(shared) == 17, sorted(shared)  # score, rewards, advantages x3; response, prompt length x4
    for key in shared:
        assert ours[key] == pytest.approx(verl[key], rel=1e-5, abs=1e-6), key
    assert not {k for k in ours if k.startswith(("critic/", "response_length/", "prompt_length/"))} - set(verl)
    tokens = int(attention.sum())
    verl_perf = compute_throughout_metrics(batch=batch, timing_raw={"step": 2.0}, n_gpus=2)
    ours_perf = throughput_metrics(tokens=tokens, step_seconds=2.0, num_devices=2)
    assert {k: ours_perf[k] for k in verl_perf} == pytest.approx(verl_perf)


def _val_case():
    sources = np.array(["a"] * 4 + ["b"] * 2)
    uids = np.array([0, 0, 1, 1, 2, 2])  # n=2 responses per prompt
    scores = np.array([1.0, 0.0, 0.5, 0.5, 0.25, 0.75])
    acc = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    return sources, uids, scores, acc


def test_validation_metrics_hand_worked():
    sources, uids, scores, acc = _val_case()
    out = validation_metrics(
        scores=scores, extras={"acc": acc}, sources=sources, uids=uids, response_lengths=np.arange(6)
    )
    assert out["val-core/a/acc/mean@2"] == 0.75 and out["val-core/b/acc/mean@2"] == 0.5
    assert out["val-aux/a/reward/mean@2"] == 0.5 and out["val-aux/b/reward/mean@2"] == 0.5
    assert out["val-aux/a/acc/std@2"] == 0.25  # mean over prompts of each prompt's std: (0.5 + 0) / 2
    assert out["val/acc"] == pytest.approx(4 / 6) and out["val/reward_mean"] == 0.5
    no_acc = validation_metrics(scores=scores, extras={}, sources=sources, uids=uids, response_lengths=np.arange(6))
    assert no_acc["val-core/a/reward/mean@2"] == 0.5 and "val/acc" not in no_acc


def test_validation_metrics_equal_verls_own():
    pytest.importorskip("verl", reason=VERL_SKIP_REASON)
    from verl.trainer.ppo.metric_utils import process_validation_metrics
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    sources, uids, scores, acc = _val_case()
    infos = {"reward": scores.tolist(), "acc": acc.tolist()}
    verl = RayPPOTrainer._val_metrics_update(None, sources, uids.tolist(), infos, [])  # uses no trainer state
    assert process_validation_metrics(sources, uids.tolist(), infos)["a"]["acc"]["mean@2"] == 0.75
    ours = validation_metrics(
        scores=scores, extras={"acc": acc}, sources=sources, uids=uids, response_lengths=np.arange(6)
    )
    per_source = {k: v for k, v in ours.items() if k.startswith("val-")}
    assert set(per_source) <= set(verl), sorted(set(per_source) - set(verl))
    assert per_source == pytest.approx({k: verl[k] for k in per_source})
    assert {k for k in verl if k.startswith("val-core/") and "/mean@" in k} <= set(per_source)


def test_console_defaults_and_phases_are_names_the_trainer_logs():
    assert {"critic/score/mean", "actor/kl_loss", "response_length/mean"} <= set(DEFAULT_RL_KEYS)
    assert not {"reward/mean", "actor/kl"} & set(DEFAULT_RL_KEYS)
    assert ("update", "timing_s/update_actor") in PHASE_TIMINGS
