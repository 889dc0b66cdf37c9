"""Causal LMs over packed batches: the built-in Llama-style decoder and the interface it meets."""

from verl_balance.models.base import PackedCausalLM
from verl_balance.models.config import ModelConfig, ModelConfigError
from verl_balance.models.llama import LlamaForCausalLM, check_sequence_parallel


def build_model(model_config: ModelConfig, *, sp_size: int = 1,
                attn_impl: str = "auto") -> PackedCausalLM:
    """The built-in decoder for `model_config` (weights drawn from torch's current RNG)."""
    return LlamaForCausalLM(model_config, sp_size=sp_size, attn_impl=attn_impl)


__all__ = [
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelConfigError",
    "PackedCausalLM",
    "build_model",
    "check_sequence_parallel",
]
