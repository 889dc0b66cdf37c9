"""CriticWorker (the value model's worker) in-process on one rank, and CriticGroup's declarations.

References: ``TrainEngine.compute_values`` of an engine built from the same seed (itself checked
against a plain per-sequence forward in tests/engine/test_value_model.py), and the value loss of
the worker's own ``eval_loss`` before and after two ``update_critic`` steps on a fixed batch.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_balance.batch_keys import MICRO_BATCH_SIZES_KEY
from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import gloo_group, new_rendezvous
from verl_balance.engine import TrainEngine
from verl_balance.engine.config import EngineConfig, EngineConfigError
from verl_balance.models.value import VALUE_HEAD_NAMES
from verl_balance.parity import ParitySettings, make_value_batch
from verl_balance.protocol import Batch
from verl_balance.single_controller.decorator import get_registration
from verl_balance.single_controller.worker_group import declared_group_methods
from verl_balance.workers.actor import ActorWorker
from verl_balance.workers.critic import CriticWarmStartError, CriticWorker, CriticWorkerConfig
from verl_balance.workers.group import CriticGroup, group_class_for

SETTINGS = ParitySettings(num_samples=6, seed=5, lr=1e-2)
MICRO_BATCH_SIZES = [2, 3, 1]
# The actor's own API, not the critic's (a CriticWorker inherits them; the critic group omits them).
ACTOR_ONLY = {"update_actor", "compute_log_prob", "set_loss_mode"}


def _config() -> CriticWorkerConfig:
    engine = SETTINGS.engine_config(agg_mode="token-mean")  # model_type is set by CriticWorkerConfig
    return CriticWorkerConfig(model=SETTINGS.model, engine=engine, cliprange_value=0.5)


@pytest.fixture(scope="module")
def critic():
    with gloo_group(rank=0, world_size=1, init_method=new_rendezvous()):
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


def _language_model_checkpoint(path: str, *, seed: int) -> dict:
    """Save a language model engine (seed ``seed``: weights unlike the critic's) and return its weights."""
    engine_config = dataclasses.replace(SETTINGS.engine_config(agg_mode="token-mean"), seed=seed)
    engine = TrainEngine(model_config=SETTINGS.model, engine_config=engine_config, layout=ParallelLayout(dp=1, sp=1))
    engine.save_checkpoint(path, step=0)
    return engine.full_state_dict()


def _fresh_critic(model=SETTINGS.model) -> CriticWorker:
    worker = CriticWorker(dataclasses.replace(_config(), model=model))
    worker.init_model()
    return worker


# The ``critic`` fixture holds the module's world-1 process group for the workers built below.
def test_backbone_warm_start_loads_the_decoder_and_keeps_the_seeded_head(critic, tmp_path):
    lm_weights = _language_model_checkpoint(str(tmp_path / "lm"), seed=SETTINGS.seed + 1)
    worker = _fresh_critic()
    before = worker.engine.full_state_dict()
    assert worker.load_backbone_weights(str(tmp_path / "lm")) is False
    after = worker.engine.full_state_dict()
    decoder = [name for name in after if name not in VALUE_HEAD_NAMES]
    assert decoder and "lm_head.weight" not in after
    for name in decoder:
        torch.testing.assert_close(after[name], lm_weights[name], rtol=0, atol=0, msg=name)
    # Negative control: the seeds differ, so the load changed the decoder.
    assert any(not torch.equal(before[name], after[name]) for name in decoder)
    for name in VALUE_HEAD_NAMES:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)


def test_backbone_warm_start_from_a_critic_checkpoint_loads_its_head(critic, tmp_path):
    critic.update_critic(_batch())  # the head moves away from its seeded initialisation
    critic.engine.save_checkpoint(str(tmp_path / "critic"), step=1)
    saved = critic.engine.full_state_dict()
    fresh = _fresh_critic()
    assert fresh.load_backbone_weights(str(tmp_path / "critic")) is True
    loaded = fresh.engine.full_state_dict()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


def test_backbone_warm_start_of_another_architecture_names_the_missing_weights(critic, tmp_path):
    _language_model_checkpoint(str(tmp_path / "lm"), seed=SETTINGS.seed)
    worker = _fresh_critic(dataclasses.replace(SETTINGS.model, num_layers=SETTINGS.model.num_layers + 1))
    with pytest.raises(CriticWarmStartError, match=f"layers.{SETTINGS.model.num_layers}"):
        worker.load_backbone_weights(str(tmp_path / "lm"))
