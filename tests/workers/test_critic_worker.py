"""CriticWorker (the value model's worker) in-process on one rank, and CriticGroup's declarations.

References: ``TrainEngine.compute_values`` of an engine built from the same seed (itself checked
against a plain per-sequence forward in tests/engine/test_value_model.py), and the value loss of
the worker's own ``eval_loss`` before and after two ``update_critic`` steps on a fixed batch.
"""

from __future__ import annotations

import pytest
import torch

from verl_balance.batch_keys import MICRO_BATCH_SIZES_KEY
from verl_balance.distributed import ParallelLayout
from verl_balance.engine import TrainEngine
from verl_balance.engine.config import EngineConfig, EngineConfigError
from verl_balance.parity import ParitySettings, make_value_batch
from verl_balance.protocol import Batch
from verl_balance.single_controller.decorator import get_registration
from verl_balance.single_controller.worker_group import declared_group_methods
from verl_balance.testing.multiprocess import free_port, gloo_group
from verl_balance.workers.actor import ActorWorker
from verl_balance.workers.critic import CriticWorker, CriticWorkerConfig
from verl_balance.workers.group import CriticGroup, group_class_for

SETTINGS = ParitySettings(num_samples=6, seed=5, lr=1e-2)
MICRO_BATCH_SIZES = [2, 3, 1]
# The actor's own API, not the critic's (a CriticWorker inherits them; the critic group omits them).
ACTOR_ONLY = {"update_actor", "compute_log_prob"}


def _config() -> CriticWorkerConfig:
    engine = SETTINGS.engine_config(agg_mode="token-mean")  # model_type is set by CriticWorkerConfig
    return CriticWorkerConfig(model=SETTINGS.model, engine=engine, cliprange_value=0.5)


@pytest.fixture(scope="module")
def critic():
    with gloo_group(rank=0, world_size=1, port=free_port()):
        worker = CriticWorker(_config())
        worker.init_model()
        yield worker


def _batch(columns=("input_ids", "attention_mask", "loss_mask", "values", "returns")) -> Batch:
    data = make_value_batch(SETTINGS)
    return Batch.from_dict(tensors={k: data[k] for k in columns}, meta={MICRO_BATCH_SIZES_KEY: MICRO_BATCH_SIZES})


def test_critic_config_forces_the_value_model():
    assert _config().engine.model_type == "value_model"
    with pytest.raises(EngineConfigError, match="cliprange_value"):
        CriticWorkerConfig(model=SETTINGS.model, engine=EngineConfig(), cliprange_value=0)


def test_compute_values_equals_the_engine_of_the_same_seed(critic):
    out = critic.compute_values(_batch(columns=("input_ids", "attention_mask")))
    data = make_value_batch(SETTINGS)
    engine = TrainEngine(model_config=SETTINGS.model, engine_config=_config().engine, layout=ParallelLayout(dp=1, sp=1))
    sizes, start, micro_batches = MICRO_BATCH_SIZES, 0, []
    for n in sizes:
        micro_batches.append({k: data[k][start : start + n] for k in ("input_ids", "attention_mask")})
        start += n
    expected = torch.cat([o["values"] for o in engine.compute_values(micro_batches)])
    assert list(out.tensors.keys()) == ["values"]
    torch.testing.assert_close(out.tensors["values"], expected, rtol=0, atol=0)
    assert expected.abs().sum() > 0


def test_two_update_critic_steps_lower_the_value_loss_on_a_fixed_batch(critic):
    batch = _batch()
    before = critic.eval_loss(batch)["loss"]
    steps = [critic.update_critic(batch) for _ in range(2)]
    after = critic.eval_loss(batch)["loss"]
    assert steps[0]["vf_loss"] == pytest.approx(before, rel=1e-6)
    assert after < 0.9 * before, (before, after)
    assert {"vf_loss", "vf_clipfrac", "vpred_mean", "grad_norm", "lr", "busy_seconds"} <= set(steps[0])
    assert "loss" not in steps[0]


def test_update_critic_names_a_missing_column(critic):
    with pytest.raises(ValueError, match="returns"):
        critic.update_critic(_batch(columns=("input_ids", "attention_mask", "loss_mask", "values")))


def test_critic_group_declares_exactly_the_critic_methods():
    declared = set(declared_group_methods(CriticGroup))
    for name in declared:
        method = getattr(CriticWorker, name, None)
        assert method is not None and get_registration(method) is not None, f"CriticWorker.{name}"
    registered = {
        name
        for cls in (ActorWorker, CriticWorker)
        for name, value in vars(cls).items()
        if callable(value) and get_registration(value) is not None
    } - ACTOR_ONLY
    assert registered == declared, registered ^ declared
    assert group_class_for(CriticWorker) is CriticGroup
