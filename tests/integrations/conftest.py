"""Shared fixtures for the verl integration tests; every test here needs verl (the `verl` extra)."""

from __future__ import annotations

import pytest

from tests._verl import VERL_SKIP_REASON
from tests.integrations.verl_ray_head import ray_head as start_ray_head


@pytest.fixture(scope="session")
def verl():
    """The verl package, or skip the test with the install hint."""
    return pytest.importorskip("verl", reason=VERL_SKIP_REASON)


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """The address of one Ray cluster for every verl subprocess of the session (``verl_ray_head.py``):
    the main_ppo runs and the pieces runners connect to it instead of starting one each."""
    with start_ray_head(str(tmp_path_factory.mktemp("ray_head"))) as address:
        yield address


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 checkpoint with its tokenizer (``save_pretrained`` layout), built locally."""
    from verl_balance.models.tiny_hf import write_tiny_model

    out = str(tmp_path_factory.mktemp("tiny_qwen2"))
    write_tiny_model(out, family="qwen2")
    return out


LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]  # k_proj / o_proj / up_proj / gate_proj keep no adapter


def write_lora_adapter(model_dir: str, out: str, *, targets, rank: int = 4, alpha: float = 8.0, seed: int = 0) -> str:
    """A peft adapter directory for ``model_dir`` with random A and B (B non-zero, unlike a fresh one)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, bias="none"))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)
    peft_model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def lora_adapter_dir(model_dir, tmp_path_factory):
    """A peft adapter (rank 4 on LORA_TARGETS, non-zero B) for ``model_dir``: one starting adapter
    for verl's fsdp2 engine and ours in the LoRA comparisons."""
    pytest.importorskip("peft")
    return write_lora_adapter(model_dir, str(tmp_path_factory.mktemp("lora_adapter")), targets=LORA_TARGETS)
