"""The small interface the engine needs from a causal LM (built-in decoder or an HF adapter).

A model consumes one packed, padding-free token stream per micro-batch (this rank's SP slice of
it) and returns logits for the same tokens. It owns its Ulysses exchange, so the engine never
needs to know where attention happens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch.distributed as dist
from torch import Tensor, nn

from verl_balance.models.config import ModelConfig

if TYPE_CHECKING:
    from verl_balance.models.hf import HFModelConfig


@runtime_checkable
class PackedCausalLM(Protocol):
    """What TrainEngine calls; LlamaForCausalLM (built-in) and HFCausalLM (Hugging Face) implement it."""

    config: ModelConfig | HFModelConfig

    def forward(self, *, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """Logits [T_local, V]; cu_seqlens spans the full padded stream (all SP slices)."""
        ...

    def set_sequence_parallel_group(self, group: dist.ProcessGroup | None) -> None:
        """Attach the Ulysses group (None or size 1: no sequence parallelism)."""
        ...

    def fsdp_units(self) -> list[nn.Module]:
        """Submodules that FSDP2 shards as separate units (typically the decoder layers)."""
        ...
