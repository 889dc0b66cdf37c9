"""Workload models: the predicted cost of processing one sequence, as a function of its length.

Invariants:
- ``cost(lengths)`` returns a float64 array of the same shape, non-negative and non-decreasing
  in length; the cost of a packed micro-batch is the sum of its sequences' costs (attention is
  causal within each sequence only, so packing adds no cross-sequence term).
- ``TokenWorkload`` is exactly the length. ``FlopsWorkload`` is forward FLOPs of a Llama-style
  decoder: linear layers (projections, SwiGLU MLP, LM head) linear in length, causal attention
  (QK^T and AV over the lower triangle) quadratic in length. The backward pass is a constant
  multiple of the forward, so it does not change any balancing decision and is not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from verl_balance.balance.errors import BalanceConfigError


class Workload(Protocol):
    """Anything with ``cost(lengths) -> float64 array``."""

    def cost(self, lengths: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class TokenWorkload:
    """Cost = number of tokens (what a token cap and memory see)."""

    name: str = "tokens"

    def cost(self, lengths: np.ndarray) -> np.ndarray:
        """Float64 cost per sequence, equal to its length."""
        return np.asarray(lengths, dtype=np.float64)


@dataclass(frozen=True)
class FlopsWorkload:
    """Forward FLOPs of a Llama-style decoder per sequence, from the model's dimensions."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int | None = None
    name: str = "flops"

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size"):
            if int(getattr(self, key)) < 1:
                raise BalanceConfigError(f"FlopsWorkload.{key} must be >= 1, got {getattr(self, key)!r}")
        if self.num_heads % self.num_kv_heads:
            raise BalanceConfigError(
                f"FlopsWorkload.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def _head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def linear_flops_per_token(self) -> float:
        """2 * (multiply-adds of every weight matrix a token passes through)."""
        h, f, d = self.hidden_size, self.intermediate_size, self._head_dim
        q_and_o = 2 * h * self.num_heads * d
        k_and_v = 2 * h * self.num_kv_heads * d
        mlp = 3 * h * f
        per_layer = q_and_o + k_and_v + mlp
        return 2.0 * (self.num_layers * per_layer + h * self.vocab_size)

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs per (query, key) pair in the causal triangle: QK^T and AV, all heads, all layers."""
        return 2.0 * 2.0 * self.num_heads * self._head_dim * self.num_layers

    def cost(self, lengths: np.ndarray) -> np.ndarray:
        """Float64 forward FLOPs per sequence: linear * L + attention * L (L + 1) / 2."""
        length = np.asarray(lengths, dtype=np.float64)
        return self.linear_flops_per_token * length + self.attention_flops_per_pair * length * (length + 1.0) / 2.0

    @classmethod
    def from_model_config(cls, cfg) -> FlopsWorkload:
        """Build from a model config: ``models.ModelConfig``, ``models.hf.HFModelConfig`` or a
        transformers config (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
        explicit ``head_dim`` when it is not hidden_size / num_heads). A multimodal config's
        ``text_config`` is used when it has one."""
        text_config = getattr(cfg, "text_config", None)
        if text_config is not None:
            cfg = text_config
        values = {}
        for key, aliases in _DIMENSION_ALIASES.items():
            found = next((getattr(cfg, a) for a in (key, *aliases) if getattr(cfg, a, None) is not None), None)
            if found is not None:
                values[key] = int(found)
        if "num_kv_heads" not in values and "num_heads" in values:
            values["num_kv_heads"] = values["num_heads"]  # HF: num_key_value_heads absent means MHA
        missing = [k for k in _DIMENSION_ALIASES if k not in values]
        if missing:
            raise BalanceConfigError(
                f"model config {type(cfg).__name__} lacks {missing}; FlopsWorkload needs {list(_DIMENSION_ALIASES)} "
                "(or their Hugging Face names); use balance.workload=tokens otherwise"
            )
        head_dim = getattr(cfg, "head_dim", None)
        return cls(**values, head_dim=None if head_dim is None else int(head_dim))


# Our dimension names -> the Hugging Face config names of the same quantity.
_DIMENSION_ALIASES = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": (),
    "intermediate_size": (),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
    "vocab_size": (),
}


def from_model_config(cfg) -> FlopsWorkload:
    """Shorthand for ``FlopsWorkload.from_model_config(cfg)``."""
    return FlopsWorkload.from_model_config(cfg)


def resolve_workload(workload) -> Workload:
    """None or "tokens" -> TokenWorkload; an object with ``cost`` is used as is."""
    if workload is None or (isinstance(workload, str) and workload == "tokens"):
        return TokenWorkload()
    if isinstance(workload, str):
        raise BalanceConfigError(
            f"workload={workload!r} is unknown; valid: None, 'tokens', or a FlopsWorkload "
            "(FlopsWorkload.from_model_config(model_config)) or any object with cost(lengths)"
        )
    if not callable(getattr(workload, "cost", None)):
        raise BalanceConfigError(f"workload {workload!r} has no cost(lengths) method")
    return workload
