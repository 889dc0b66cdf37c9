"""How a model family turns the output projection into logits.

Most families use ``logits = hidden @ W_out^T``. Some add a fixed transform after the projection:
Granite divides by ``logits_scaling``; Gemma 2/3 soft-cap with ``final_logit_softcapping``
(``c * tanh(logits / c)``). Every path that produces logits (the model's own ``forward``, a
chunked output head, a rollout) applies the same ``LogitTransform``, so they agree exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LogitTransform:
    """``logits = softcap(scale * (hidden @ W_out^T))``; ``softcap`` None means no capping."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"logit scale={self.scale} must be > 0")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"final_logit_softcapping={self.softcap} must be > 0 or None")

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply(self, logits: Tensor) -> Tensor:
        """The transform on projected logits (differentiable, dtype kept)."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @classmethod
    def from_hf_config(cls, hf_config) -> LogitTransform:
        """Read the families' keys: ``logits_scaling`` (Granite divides by it) and
        ``final_logit_softcapping`` (Gemma 2/3); absent keys mean identity."""
        logits_scaling = getattr(hf_config, "logits_scaling", None)
        softcap = getattr(hf_config, "final_logit_softcapping", None)
        return cls(
            scale=1.0 / float(logits_scaling) if logits_scaling else 1.0,
            softcap=float(softcap) if softcap else None,
        )
