"""Log-probs at a sampling temperature: the engine must score tokens under softmax(logits / T),
the distribution the rollout sampled from, in compute_log_prob and in the loss alike.

Reference: a plain per-sequence forward of the same initial model, logits divided by T.
"""

import pytest
import torch

from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.distributed.layout import ParallelLayout
from verl_balance.engine.train_engine import TrainEngine
from verl_balance.parity import ParitySettings, make_global_batch, reference_log_probs

pytestmark = pytest.mark.slow  # spawns a process group

SETTINGS = ParitySettings()
TEMPERATURE = 0.7


def _engine_outputs(rank):
    batch = make_global_batch(SETTINGS)
    engine = TrainEngine(
        model_config=SETTINGS.model,
        engine_config=SETTINGS.engine_config(agg_mode="token-mean"),
        layout=ParallelLayout(dp=1, sp=2),
    )
    log_probs = engine.compute_log_prob([batch], temperature=TEMPERATURE)[0]["log_probs"]
    loss = engine.eval_loss([batch], temperature=TEMPERATURE)["loss"]
    untempered = engine.eval_loss([batch])["loss"]
    return log_probs, loss, untempered


def test_log_probs_and_loss_use_the_sampling_temperature():
    batch = make_global_batch(SETTINGS)
    want = reference_log_probs(SETTINGS, batch, temperature=TEMPERATURE)
    mask = batch["loss_mask"].clone()
    mask[:, 0] = 0
    want_loss = float(-(want * mask).sum() / mask.sum())

    for log_probs, loss, untempered in run_on_ranks(_engine_outputs, world=2):  # sp=2: both SP ranks
        torch.testing.assert_close(log_probs, want, rtol=1e-5, atol=1e-5)
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss)
        assert abs(untempered - want_loss) > 1e-3  # temperature 1 is a different distribution
