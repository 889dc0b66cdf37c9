"""LoRA in TrainEngine (engine/lora.py): only the adapters train, and a LoRA run has the same loss and
gradient norm at every layout (dp1, dp2, dp1 x sp2; fixed and dynamic micro-batches).

References are independent of the engine's sharding: the dp1 single-process run, and peft's own
``get_peft_model`` on the plain HF model for the initial logits.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from verl_balance.distributed import ParallelLayout
from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.engine import EngineConfig, TrainEngine
from verl_balance.engine.config import EngineConfigError, OptimConfig
from verl_balance.engine.lora import is_lora_name
from verl_balance.models.hf import HFModelConfig
from verl_balance.models.tiny_hf import write_tiny_model
from verl_balance.testing.faults import FaultyTrainEngine

pytestmark = pytest.mark.slow  # spawns process groups

LENGTHS = [9, 4, 12, 7, 5, 10, 3, 8]
STEPS = 3
# DP rank -> micro-batches (sample indices). "fixed": equal counts; "dynamic": uneven packs.
SPLITS = {
    "fixed": {1: {0: [[0, 1], [2, 3], [4, 5], [6, 7]]}, 2: {0: [[0, 1], [2, 3]], 1: [[4, 5], [6, 7]]}},
    "dynamic": {1: {0: [[0, 1, 2], [3], [4, 5, 6, 7]]}, 2: {0: [[0], [1, 2, 3]], 1: [[4, 5, 6], [7]]}},
}
LAYOUTS = {"dp2": (2, 1), "sp2": (1, 2)}


# AdamW's update is g / (|g| + eps) per unit of lr: at the default eps (1e-8) an entry whose gradient is at
# rounding level moves by up to lr on one CPU and not on another. eps = 1e-5 (as the parity harness,
# verl_balance/parity.py) bounds that to lr * (gradient rounding) / eps.
ADAM_EPS = 1e-5


def _config(**kw) -> EngineConfig:
    optim = OptimConfig(lr=2e-2, eps=ADAM_EPS, weight_decay=0.0, clip_grad=None)
    return EngineConfig(seed=5, lora_rank=4, lora_alpha=8, optim=optim, **kw)


def _batch(vocab_size: int) -> dict:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, min(vocab_size, 300), (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = (torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "loss_mask": mask.float()}


def _micro_batches(batch, idx_lists):
    return [{k: v[torch.tensor(idx, dtype=torch.long)] for k, v in batch.items()} for idx in idx_lists]


def _train(model_config, dp, sp, split, *, engine_cls=TrainEngine, **engine_kw) -> dict:
    layout = ParallelLayout(dp=dp, sp=sp, device_type="cpu")
    engine = engine_cls(model_config=model_config, engine_config=_config(), layout=layout, **engine_kw)
    batch = _batch(model_config.vocab_size)
    mbs = _micro_batches(batch, SPLITS[split][dp][layout.dp_rank])
    before = engine.full_state_dict()
    steps = [engine.train_batch(mbs) for _ in range(STEPS)]
    after = engine.full_state_dict()
    trainable = sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)
    optim_params = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    in_state = {id(p) for p in engine.optimizer.state}
    named = dict(engine.model.named_parameters())
    return {
        "loss": [s["loss"] for s in steps],
        "grad_norm": [s["grad_norm"] for s in steps],
        "before": before,
        "after": after,
        "trainable": trainable,
        "optimizer_params": sorted(n for n, p in named.items() if id(p) in optim_params),
        "optimizer_state": sorted(n for n, p in named.items() if id(p) in in_state),
    }


def _world2(rank, *, path):
    config = HFModelConfig.from_pretrained(path)
    out = {}
    for split in SPLITS:
        for lname, (dp, sp) in LAYOUTS.items():
            out[lname, split] = _train(config, dp, sp, split)
    out["bad_normaliser"] = _train(config, 2, 1, "dynamic", engine_cls=FaultyTrainEngine, bug="micro_batch_mean")
    return out


def _world1(rank, *, path):
    config = HFModelConfig.from_pretrained(path)
    return {split: _train(config, 1, 1, split) for split in SPLITS}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(str(tmp_path_factory.mktemp("lora") / "qwen2"), family="qwen2", initializer_range=0.02)


@pytest.fixture(scope="module")
def runs(model_dir):
    single = run_on_ranks(functools.partial(_world1, path=model_dir), world=1)[0]
    multi = run_on_ranks(functools.partial(_world2, path=model_dir), world=2)
    return single, multi


def test_only_adapters_are_trainable_and_hold_optimizer_state(runs):
    single, _ = runs
    run = single["fixed"]
    assert run["trainable"] and all(is_lora_name(n) for n in run["trainable"])
    assert any(".lora_A." in n for n in run["trainable"]) and any(".lora_B." in n for n in run["trainable"])
    assert run["optimizer_params"] == run["trainable"]
    assert run["optimizer_state"] == run["trainable"]


def test_base_weights_unchanged_and_adapters_trained(runs):
    single, multi = runs
    for run in [single["fixed"], multi[0]["dp2", "fixed"]]:
        for name, value in run["before"].items():
            assert torch.equal(value, run["after"][name]) != is_lora_name(name), name
        assert run["loss"][-1] < run["loss"][0]


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("lname", list(LAYOUTS))
def test_lora_loss_and_grad_norm_are_layout_invariant(runs, lname, split):
    single, multi = runs
    ref = single["fixed"]  # one process, one layout: the reference of every layout and split
    for rank_result in multi:
        run = rank_result[lname, split]
        torch.testing.assert_close(torch.tensor(run["loss"]), torch.tensor(ref["loss"]), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(run["grad_norm"]), torch.tensor(ref["grad_norm"]), rtol=1e-5, atol=0)
        # Weights after 3 Adam steps (updates ~lr = 2e-2): with ADAM_EPS a gradient rounding error d moves an
        # update by at most lr * d / eps, so a rounding-level gradient entry no longer flips by ~lr: atol 2e-5.
        for name, value in ref["after"].items():
            torch.testing.assert_close(run["after"][name], value, rtol=1e-5, atol=2e-5, msg=name)


def test_lora_initial_weights_are_the_same_at_every_layout(runs):
    single, multi = runs
    for key in [("dp2", "fixed"), ("sp2", "dynamic")]:
        for name, value in single["fixed"]["before"].items():
            assert torch.equal(multi[0][key]["before"][name], value), name


def test_negative_control_micro_batch_mean_is_detected(runs):
    single, multi = runs
    bad = multi[0]["bad_normaliser"]
    assert not torch.allclose(torch.tensor(bad["grad_norm"]), torch.tensor(single["fixed"]["grad_norm"]), rtol=1e-5)


def _initial_logits(rank, *, path):
    config = HFModelConfig.from_pretrained(path)
    engine = TrainEngine(
        model_config=config, engine_config=_config(), layout=ParallelLayout(dp=1, sp=1, device_type="cpu")
    )
    batch = _batch(config.vocab_size)
    [out] = engine.compute_log_prob([batch])
    return out["log_probs"]


def test_fresh_lora_model_computes_the_base_models_log_probs(model_dir):
    """B = 0 at start: the engine's LoRA model equals the plain HF model (independent reference)."""
    from transformers import AutoModelForCausalLM

    log_probs = run_on_ranks(functools.partial(_initial_logits, path=model_dir), world=1)[0]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = _batch(hf.config.vocab_size)
    for i, n in enumerate(LENGTHS):
        ids = batch["input_ids"][i, :n]
        logits = hf(input_ids=ids[None]).logits[0].float()
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        torch.testing.assert_close(log_probs[i, 1:n], ref, rtol=1e-4, atol=1e-5)


def _build_error(rank, *, path, **kw):
    config = HFModelConfig.from_pretrained(path) if path else None
    from verl_balance.models import ModelConfig

    try:
        TrainEngine(
            model_config=config or ModelConfig.preset("tiny"),
            engine_config=dataclasses.replace(_config(), **kw),
            layout=ParallelLayout(dp=1, sp=1, device_type="cpu"),
        )
    except EngineConfigError as err:
        return str(err)
    return None


def test_bad_lora_settings_are_refused_naming_the_key(model_dir):
    err = run_on_ranks(functools.partial(_build_error, path=model_dir, target_modules=["qkv"]), world=1)[0]
    assert err and "target_modules" in err and "q_proj" in err
    err = run_on_ranks(functools.partial(_build_error, path=None), world=1)[0]
    assert err and "lora_rank" in err and "model.path" in err
    with pytest.raises(EngineConfigError, match="lora_rank"):
        EngineConfig(lora_rank=-1)
