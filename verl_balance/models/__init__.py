"""Causal LMs over packed batches: the built-in decoder, Hugging Face models, and their config loader."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from verl_balance.models.base import PackedCausalLM
from verl_balance.models.config import ModelConfig, ModelConfigError
from verl_balance.models.llama import LlamaForCausalLM, check_sequence_parallel

# Dimension keys a preset may override (HF directories fix theirs).
MODEL_DIMENSION_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
)
# Keys that only a Hugging Face model (model.path) understands.
HF_ONLY_KEYS = ("init",)
# Keys of how a model runs (not its dimensions) that both kinds understand.
MODEL_RUNTIME_KEYS = ("enable_gradient_checkpointing",)


def build_model(model_config, *, sp_size: int = 1, attn_impl: str = "auto") -> PackedCausalLM:
    """The built-in decoder (torch's current RNG) for a ``ModelConfig``, ``HFCausalLM`` for an ``HFModelConfig``."""
    if isinstance(model_config, ModelConfig):
        return LlamaForCausalLM(model_config, sp_size=sp_size, attn_impl=attn_impl)
    from verl_balance.models.hf import HFCausalLM, HFModelConfig

    if isinstance(model_config, HFModelConfig):
        return HFCausalLM(model_config, sp_size=sp_size, attn_impl=attn_impl)
    raise ModelConfigError(f"model config of type {type(model_config).__name__}; valid: ModelConfig, HFModelConfig")


def load_model_config(*, name: str | None, path: str | None, overrides: dict[str, Any] | None = None, vocab_size: int):
    """``HFModelConfig`` for a local HF directory (``path``), else the built-in preset ``name``.

    ``overrides`` (None ignored): for a directory only ``init``/``enable_gradient_checkpointing`` and
    dimension keys equal to the directory's. The model's vocabulary must hold the tokenizer's."""
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if path is None:
        if name is None:
            raise ModelConfigError("set model.name (a built-in preset) or model.path (a local HF directory)")
        unknown = sorted(set(overrides) - set(MODEL_DIMENSION_KEYS) - set(MODEL_RUNTIME_KEYS))
        if unknown:
            raise ModelConfigError(
                f"model.{unknown[0]} does not apply to the built-in preset {name!r}; valid "
                f"overrides: {MODEL_DIMENSION_KEYS + MODEL_RUNTIME_KEYS} ({HF_ONLY_KEYS} need model.path)"
            )
        overrides.setdefault("vocab_size", vocab_size)
        config = replace(ModelConfig.preset(name), **overrides)
    else:
        from verl_balance.models.hf import HFModelConfig

        hf_keys = HF_ONLY_KEYS + MODEL_RUNTIME_KEYS
        unknown = sorted(set(overrides) - set(MODEL_DIMENSION_KEYS) - set(hf_keys))
        if unknown:
            raise ModelConfigError(f"model.{unknown[0]} is not a model key; valid: {MODEL_DIMENSION_KEYS + hf_keys}")
        config = HFModelConfig.from_pretrained(path, **{k: overrides[k] for k in hf_keys if k in overrides})
        for key in MODEL_DIMENSION_KEYS:
            if key in overrides and overrides[key] != getattr(config, key):
                raise ModelConfigError(
                    f"model.{key}={overrides[key]!r} conflicts with model.path={path!r} "
                    f"({key}={getattr(config, key)!r}); remove model.{key}"
                )
    if config.vocab_size < vocab_size:
        raise ModelConfigError(
            f"model vocab_size={config.vocab_size} is smaller than the tokenizer's vocabulary ({vocab_size})"
        )
    return config


__all__ = [
    "HF_ONLY_KEYS",
    "MODEL_DIMENSION_KEYS",
    "MODEL_RUNTIME_KEYS",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelConfigError",
    "PackedCausalLM",
    "build_model",
    "check_sequence_parallel",
    "load_model_config",
]
