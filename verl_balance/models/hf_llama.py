"""The built-in decoder as transformers' ``LlamaForCausalLM`` (the same math under HF's names), for
the streamed export of a sharded engine and ``python -m verl_balance.export``."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from verl_balance.models.config import ModelConfig

# Built-in parameter name (models/llama.py) -> transformers LlamaForCausalLM name, per layer.
_BUILTIN_LAYER_NAMES = {
    "input_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}


def builtin_to_hf_llama(state_dict: Mapping[str, torch.Tensor], *, model_config: ModelConfig):
    """(transformers LlamaConfig, HF-named state dict) of a built-in model; HF's Llama gives the same logits."""
    from transformers import LlamaConfig

    c = model_config
    hf_config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
        initializer_range=c.initializer_range,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    out = {
        "model.embed_tokens.weight": state_dict["embed_tokens.weight"],
        "model.norm.weight": state_dict["norm.weight"],
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = state_dict["lm_head.weight"]
    for i in range(c.num_layers):
        for ours, theirs in _BUILTIN_LAYER_NAMES.items():
            out[f"model.layers.{i}.{theirs}"] = state_dict[f"layers.{i}.{ours}"]
    return hf_config, out


def save_builtin_as_hf_llama(
    state_dict: Mapping[str, torch.Tensor], *, model_config: ModelConfig, out: str, tokenizer_path: str | None = None
) -> str:
    """Write a built-in model's weights as a transformers ``LlamaForCausalLM`` directory."""
    from transformers import AutoModelForCausalLM

    hf_config, hf_state = builtin_to_hf_llama(state_dict, model_config=model_config)
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        params = model.state_dict()
        for name, tensor in hf_state.items():
            params[name].copy_(tensor)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_path and os.path.exists(os.path.join(tokenizer_path, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True).save_pretrained(out)
    return out
