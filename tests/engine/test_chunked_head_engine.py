"""The chunked output head inside TrainEngine at dp=2 x sp=2 (FSDP2 + Ulysses): train_batch (PPO loss
with entropy and KL terms, sampling temperature 0.7) and compute_log_prob give the same losses,
gradient norm, updated parameters, log-probs and entropies as the unchunked head."""

import dataclasses

import pytest
import torch

from verl_balance.algorithms.policy_loss import PolicyLossConfig, PPOLoss
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.distributed.layout import ParallelLayout
from verl_balance.engine.train_engine import TrainEngine
from verl_balance.parity import ParitySettings, make_global_batch

pytestmark = pytest.mark.slow  # spawns a process group

SETTINGS = ParitySettings()
TEMPERATURE = 0.7
CHUNK_SIZES = (0, 5)  # 0: the unchunked reference head; 5 divides no micro-batch


def _ppo_micro_batches(dp_rank: int) -> list[dict]:
    batch = make_global_batch(SETTINGS)
    g = torch.Generator().manual_seed(5)
    shape = batch["input_ids"].shape
    batch["old_log_probs"] = torch.randn(shape, generator=g) * 0.1 - 4.0
    batch["ref_log_prob"] = torch.randn(shape, generator=g) * 0.1 - 4.0
    batch["advantages"] = torch.randn(shape, generator=g)
    rows = torch.arange(dp_rank, shape[0], 2)
    mine = {k: v[rows] for k, v in batch.items()}
    return [{k: v[i : i + 3] for k, v in mine.items()} for i in range(0, len(rows), 3)]


def _run(rank: int) -> dict:
    layout = ParallelLayout(dp=2, sp=2)
    loss_fn = PPOLoss(PolicyLossConfig(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1))
    out = {}
    for chunk in CHUNK_SIZES:
        config = dataclasses.replace(SETTINGS.engine_config(agg_mode="token-mean"), logits_chunk_size=chunk)
        engine = TrainEngine(model_config=SETTINGS.model, engine_config=config, layout=layout)
        micro_batches = _ppo_micro_batches(layout.dp_rank)
        log_probs = engine.compute_log_prob(micro_batches, with_entropy=True, temperature=TEMPERATURE)
        metrics = engine.train_batch(micro_batches, loss_fn=loss_fn, temperature=TEMPERATURE)
        out[chunk] = {
            "log_probs": [m["log_probs"] for m in log_probs],
            "entropy": [m["entropy"] for m in log_probs],
            "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"],
            "entropy_metric": metrics["entropy"],
            "params": engine.full_state_dict(),
        }
    return out


def test_chunked_head_train_step_and_log_probs_equal_the_unchunked_head_at_dp2_sp2():
    for result in run_on_ranks(_run, world=4):
        reference, chunked = (result[c] for c in CHUNK_SIZES)
        for key in ("loss", "grad_norm", "entropy_metric"):
            assert abs(chunked[key] - reference[key]) <= 1e-6 * abs(reference[key]), key
        assert reference["grad_norm"] > 0
        for key in ("log_probs", "entropy"):
            for got, want in zip(chunked[key], reference[key]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for name, want in reference["params"].items():
            torch.testing.assert_close(chunked["params"][name], want, rtol=0, atol=1e-6, msg=name)
