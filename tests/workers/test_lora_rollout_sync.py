"""ActorRolloutWorker with LoRA: the rollout receives the merged weights and the reference policy is
the base model with its adapters disabled.

References (no engine code): peft's ``merge_and_unload`` of the plain HF model carrying the same
adapter tensors, and a plain HF forward of the base model for the reference log-probs.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from verl_balance.distributed.launcher import run_on_ranks
from verl_balance.engine import EngineConfig
from verl_balance.engine.config import OptimConfig
from verl_balance.engine.lora import is_lora_name, peft_key
from verl_balance.models.hf import HFModelConfig
from verl_balance.models.tiny_hf import write_tiny_model

pytestmark = pytest.mark.slow  # spawns process groups

LENGTHS = [7, 4, 9, 5]


def _worker(rank: int, *, path: str, world: int):
    from verl_balance.workers.actor_rollout import ActorRolloutWorker, ActorRolloutWorkerConfig

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    engine = EngineConfig(seed=3, lora_rank=4, lora_alpha=8, target_modules="all-linear", optim=OptimConfig(lr=1e-2))
    config = ActorRolloutWorkerConfig(
        model=HFModelConfig.from_pretrained(path), engine=engine, use_reference_policy=True
    )
    worker = ActorRolloutWorker(config)
    worker.init_model()
    return worker


def _perturb_adapters(worker, *, seed: int) -> None:
    """Give every adapter (B too, which starts at 0) random values, the same on every rank."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(worker.engine.model.named_parameters()):
        if not is_lora_name(name):
            continue
        full = 0.3 * torch.randn(param.shape, generator=gen)
        with torch.no_grad():
            if isinstance(param, DTensor):
                param.copy_(distribute_tensor(full, param.device_mesh, param.placements))
            else:
                param.copy_(full)


def _sync_and_ref(rank: int, *, path: str, world: int) -> dict:
    from verl_balance.batch_keys import MICRO_BATCH_SIZES_KEY
    from verl_balance.protocol import Batch

    worker = _worker(rank, path=path, world=world)
    assert worker.ref_engine is None  # no second model copy
    out = {}
    for seed in (1, 2):  # the first sync, then the in-place path after the adapters changed
        _perturb_adapters(worker, seed=seed)
        worker.engine.global_step += 1  # what an optimizer step does to trigger a refresh
        worker._refresh_rollout_weights()
        out[f"rollout_{seed}"] = {k: v.clone() for k, v in worker._rollout_state.items()}
        out[f"adapters_{seed}"] = {k: v for k, v in worker.engine.full_state_dict().items() if is_lora_name(k)}
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 200, (len(LENGTHS), max(LENGTHS)), generator=gen)
    mask = (torch.arange(max(LENGTHS))[None] < torch.tensor(LENGTHS)[:, None]).long()
    batch = Batch.from_dict(tensors={"input_ids": ids * mask, "attention_mask": mask})
    batch.meta[MICRO_BATCH_SIZES_KEY] = [2, 2]
    out["batch"] = (ids * mask, mask)
    out["ref"] = worker.compute_ref_log_prob(batch)["ref_log_prob"]
    out["actor"] = worker.compute_log_prob(batch)["log_probs"]
    out["ref_again"] = worker.compute_ref_log_prob(batch)["ref_log_prob"]  # adapters re-enabled in between
    out["trainable"] = sorted(n for n, p in worker.engine.model.named_parameters() if p.requires_grad)
    return out


def _peft_merged(path: str, adapters: dict) -> dict:
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    model = get_peft_model(base, lora)
    adapter_state = {peft_key(k): v for k, v in adapters.items()}
    result = set_peft_model_state_dict(model, adapter_state)
    assert not result.unexpected_keys
    return model.merge_and_unload().state_dict()


def _base_log_probs(path: str, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = torch.zeros(ids.shape)
    with torch.no_grad():
        for i, n in enumerate(mask.sum(1).tolist()):  # one unpadded sequence at a time
            logits = model(input_ids=ids[i : i + 1, :n]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], dim=-1).gather(-1, ids[i, 1:n, None])[:, 0]
            out[i, 1:n] = lp
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("lora_sync") / "model"), family="qwen2")


@pytest.fixture(scope="module", params=[1, 2], ids=["world1", "dp2"])
def runs(request, model_dir):
    world = request.param
    return model_dir, run_on_ranks(functools.partial(_sync_and_ref, path=model_dir, world=world), world=world)


def test_rollout_gets_peft_merged_weights_first_sync_and_after_update(runs):
    path, results = runs
    for seed in (1, 2):
        expected = _peft_merged(path, results[0][f"adapters_{seed}"])
        for rank_result in results:
            got = rank_result[f"rollout_{seed}"]
            assert sorted(got) == sorted(k for k in expected if k != "lm_head.weight" or k in got)
            for name, tensor in got.items():
                torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    # Negative control: the adapters changed between the syncs, and so did the merged q_proj.
    first, second = results[0]["rollout_1"], results[0]["rollout_2"]
    name = "model.layers.0.self_attn.q_proj.weight"
    assert (first[name] - second[name]).abs().max() > 1e-3


def test_reference_log_probs_are_the_base_models_and_adapters_come_back(runs):
    path, results = runs
    ids, mask = results[0]["batch"]
    base = _base_log_probs(path, ids, mask)
    for rank_result in results:
        torch.testing.assert_close(rank_result["ref"], base, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rank_result["ref_again"], rank_result["ref"], rtol=0, atol=0)
        # Negative control: the actor (adapters on, B != 0) is a different policy.
        assert (rank_result["actor"] - base).abs().max() > 1e-2
        assert rank_result["trainable"] and all(is_lora_name(n) for n in rank_result["trainable"])
