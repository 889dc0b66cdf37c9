"""ModelConfig: dimensions of the built-in Llama-style decoder (a contract with the rollout side)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


class ModelConfigError(ValueError):
    """An inconsistent model configuration, or one that does not fit the parallel layout."""


@dataclass(frozen=True)
class ModelConfig:
    """Llama-style decoder dimensions (HF-Llama conventions, no biases)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    enable_gradient_checkpointing: bool = False
    """Activation checkpointing per decoder layer in training (verl's model key); not a dimension."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ModelConfigError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict:
        """Plain dict of the fields (for logging and checkpoints)."""
        return asdict(self)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        """Named configurations: "tiny" (fast CPU tests), "small", "100m" (~100M parameters)."""
        if name not in _PRESETS:
            raise ModelConfigError(f"unknown model preset {name!r}; valid: {sorted(_PRESETS)}")
        return cls(**_PRESETS[name])


_PRESETS = {
    "tiny": dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=1024,
    ),
    "small": dict(
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=704,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_position_embeddings=2048,
    ),
    # 32000 * 768 tied embedding (24.6M) + 12 layers * 6.3M = ~100M parameters.
    "100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=12,
        num_heads=12,
        num_kv_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
}
