"""The small interface the engine needs from a causal LM (built-in decoder or an HF adapter): one
packed, padding-free stream per micro-batch (this rank's SP slice) in, logits for the same tokens
out; the model owns its Ulysses exchange."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch.distributed as dist
from torch import Tensor, nn

from verl_balance.models.config import ModelConfig
from verl_balance.models.output_head import LogitTransform, Temperature

if TYPE_CHECKING:
    from verl_balance.models.hf import HFModelConfig


@runtime_checkable
class PackedCausalLM(Protocol):
    """What TrainEngine calls; LlamaForCausalLM (built-in) and HFCausalLM (Hugging Face) implement it."""

    config: ModelConfig | HFModelConfig
    logit_transform: LogitTransform
    """The family's transform after the output projection (identity for most)."""

    def forward(
        self,
        *,
        input_ids: Tensor,
        position_ids: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        targets: Tensor | None = None,
        temperature: Temperature = 1.0,
        with_entropy: bool = False,
        with_sum_pi_squared: bool = False,
        logits_chunk_size: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor | None]:
        """Logits [T_local, V]; cu_seqlens spans the full padded stream (all SP slices).

        With ``targets`` [T_local]: (log p(target), entropy or None) at ``temperature`` instead."""
        ...

    def forward_hidden(self, *, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """Final (normed) hidden states [T_local, H], the input of the output projection."""
        ...

    def output_weight(self) -> Tensor:
        """The output projection weight [V, H] (the input embedding when tied)."""
        ...

    def set_sequence_parallel_group(self, group: dist.ProcessGroup | None) -> None:
        """Attach the Ulysses group (None or size 1: no sequence parallelism)."""
        ...

    def fsdp_units(self) -> list[nn.Module]:
        """Submodules that FSDP2 shards as separate units (typically the decoder layers)."""
        ...
