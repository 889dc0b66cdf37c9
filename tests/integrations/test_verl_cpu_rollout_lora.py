"""The CPU rollout server applies what verl's LoRA weight sync sends (``cpu_rollout.py``): the base
weights under peft's ``.base_layer`` names, then adapters alone (peft's adapter-file keys) merged
into its base copy, or merged weights. Reference: peft's own ``PeftModel`` forward (un-merged
adapters) on the same base and adapter."""

from __future__ import annotations

import pytest

from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)
pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "up_proj"]


@pytest.fixture(scope="module")
def cpu_rollout():
    from verl_balance.integrations.verl.cpu_shims import rollout as cpu_rollout

    return cpu_rollout


def make_server(cpu_rollout, model_dir: str, *, load_format: str):
    from verl.workers.config import HFModelConfig, RolloutConfig

    config = RolloutConfig(
        name=cpu_rollout.ROLLOUT_NAME, dtype="float32", load_format=load_format, prompt_length=32, response_length=8
    )
    return cpu_rollout.CPURolloutServer(config=config, model_config=HFModelConfig(path=model_dir), replica_rank=0)


def peft_model(model_dir: str, *, seed: int, targets=TARGETS, rank: int = 4, alpha: float = 8.0, use_rslora=False):
    """A PeftModel on a perturbed copy of the base (so a rollout keeping its own weights is caught),
    with random non-zero A and B."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in base.parameters():
            param.add_(0.01 * torch.randn_like(param))
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    return model.eval()


def base_sync(model) -> dict:
    """What verl's fsdp engine sends with base_sync_done=False (collect_lora_params + replace_lora_wrapper)."""
    from verl.utils.fsdp_utils import replace_lora_wrapper

    config = model.peft_config["default"]
    out = {}
    for name, tensor in model.base_model.model.state_dict().items():
        if "lora_" in name:
            continue
        out[replace_lora_wrapper(name.replace(".base_layer", ""), config)] = tensor.clone()
    return out


def adapter_sync(model) -> tuple[dict, dict]:
    """What it sends with base_sync_done=True: peft's adapter state dict and the peft config dict."""
    from peft.utils.save_and_load import get_peft_model_state_dict

    tensors = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    return tensors, model.peft_config["default"].to_dict()


def plain_base(model) -> dict:
    """The base weights of a PeftModel under HF names."""
    return {k.replace(".base_layer", ""): v for k, v in model.base_model.model.state_dict().items() if "lora_" not in k}


def set_base(model, base: dict) -> None:
    """Give a PeftModel the base weights ``base`` (HF names)."""
    import torch

    with torch.no_grad():
        for name, tensor in model.base_model.model.state_dict().items():
            if "lora_" not in name:
                tensor.copy_(base[name.replace(".base_layer", "")])


def logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


IDS = [1, 40, 41, 42, 43, 7, 9, 100]


def test_base_then_adapter_syncs_give_peft_models_logits_and_a_new_adapter_replaces_the_old(cpu_rollout, model_dir):
    import torch

    server = make_server(cpu_rollout, model_dir, load_format="dummy")
    first = peft_model(model_dir, seed=1)
    base = base_sync(first)
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in base  # peft's names reach the server
    server.load_weights(base, global_steps=0)
    with first.disable_adapter():
        torch.testing.assert_close(logits(server.model, IDS), logits(first, IDS), rtol=1e-5, atol=1e-5)
    tensors, config = adapter_sync(first)
    assert server.load_adapters(tensors, peft_config=config, global_steps=1) == 2 * len(TARGETS)
    torch.testing.assert_close(logits(server.model, IDS), logits(first, IDS), rtol=1e-5, atol=1e-5)
    assert server.weights_version == 1
    # The next step's adapters (on q_proj and v_proj only) apply to the base, not on top of the last
    # merge; k_proj / up_proj get their base weights back.
    second = peft_model(model_dir, seed=2, targets=["q_proj", "v_proj"])
    set_base(second, plain_base(first))
    tensors, config = adapter_sync(second)
    server.load_adapters(tensors, peft_config=config, global_steps=2)
    torch.testing.assert_close(logits(server.model, IDS), logits(second, IDS), rtol=1e-5, atol=1e-5)
    # Negative control: the first adapter is far from the second.
    assert (logits(first, IDS) - logits(second, IDS)).abs().max() > 1e-2


def test_adapters_on_a_pretrained_base_with_rslora_and_then_merged_weights(cpu_rollout, model_dir):
    import torch

    server = make_server(cpu_rollout, model_dir, load_format="auto")  # base from model.path: no base sync
    model = peft_model(model_dir, seed=3, use_rslora=True, rank=8)
    set_base(model, server.model.state_dict())  # the pretrained base, as on the rollout
    tensors, config = adapter_sync(model)
    server.load_adapters(tensors, peft_config=config)
    torch.testing.assert_close(logits(server.model, IDS), logits(model, IDS), rtol=1e-5, atol=1e-5)
    # model.lora.merge=True: plain HF names, the merged model replaces everything.
    merged = peft_model(model_dir, seed=4).merge_and_unload()
    server.load_weights({k: v for k, v in merged.state_dict().items() if k != "lm_head.weight"})
    torch.testing.assert_close(logits(server.model, IDS), logits(merged, IDS), rtol=1e-5, atol=1e-5)
    assert server.base_weights == {}


def test_adapter_syncs_the_server_cannot_apply_are_refused(cpu_rollout, model_dir):
    server = make_server(cpu_rollout, model_dir, load_format="dummy")
    model = peft_model(model_dir, seed=5)
    tensors, config = adapter_sync(model)
    with pytest.raises(cpu_rollout.CPURolloutError, match="before any base weights"):
        server.load_adapters(tensors, peft_config=config)
    server.load_weights(base_sync(model))
    only_a = {k: v for k, v in tensors.items() if "lora_B" not in k}
    with pytest.raises(cpu_rollout.CPURolloutError, match="both lora_A and lora_B"):
        server.load_adapters(only_a, peft_config=config)
    with pytest.raises(cpu_rollout.CPURolloutError, match="r=2"):
        server.load_adapters(tensors, peft_config={**config, "r": 2})
    with pytest.raises(cpu_rollout.CPURolloutError, match="use_dora"):
        server.load_adapters(tensors, peft_config={**config, "use_dora": True})
    with pytest.raises(cpu_rollout.CPURolloutError, match="not a LoRA adapter key"):
        server.load_adapters({"model.norm.weight": tensors[next(iter(tensors))]}, peft_config=config)
    renamed = {k.replace("q_proj", "nope_proj"): v for k, v in tensors.items()}
    with pytest.raises(cpu_rollout.CPURolloutError, match="no such model weight"):
        server.load_adapters(renamed, peft_config=config)
