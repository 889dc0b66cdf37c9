"""A value model: a decoder backbone plus a scalar head per token (verl's critic).

Invariants:
- No ``lm_head``; parameter names are the backbone's plus ``score.weight`` / ``score.bias`` (HF
  token-classification keys); a fresh head is the same at every layout.
- values[i, t] is the head on token t - 1's hidden state, aligned like log_probs[i, t].
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

from verl_balance.models.base import PackedCausalLM

VALUE_HEAD_NAMES = ("score.weight", "score.bias")
DEFAULT_INITIALIZER_RANGE = 0.02


def _initializer_range(backbone: nn.Module) -> float:
    hf_model = getattr(backbone, "hf_model", None)
    config = hf_model.config if hf_model is not None else backbone.config
    return float(getattr(config, "initializer_range", None) or DEFAULT_INITIALIZER_RANGE)


class ValueModel(nn.Module):
    """A backbone's final hidden states -> one scalar per token (see module docstring)."""

    head_parameter_names = VALUE_HEAD_NAMES

    def __init__(self, backbone: PackedCausalLM):
        super().__init__()
        hidden_size = backbone.config.hidden_size
        self.config = backbone.config
        self.initializer_range = _initializer_range(backbone)
        # The backbone's children, minus the output projection, become this module's children, so
        # parameter names are the backbone's own; the backbone itself is held outside the tree.
        for name, child in list(backbone.named_children()):
            if name != "lm_head":
                self.add_module(name, child)
        # The dropped projection's shape: fill_builtin_random replays its draws, so the backbone's
        # weights are the language model's at the same seed.
        self.dropped_parameters: dict[str, tuple[int, ...]] = {}
        if hasattr(backbone, "lm_head"):
            self.dropped_parameters = {"lm_head.weight": tuple(backbone.lm_head.weight.shape)}
            del backbone.lm_head
        object.__setattr__(self, "backbone", backbone)
        if getattr(backbone, "hf_model", None) is not None:
            object.__setattr__(self, "hf_model", backbone.hf_model)  # fill_hf_random's _init_weights
        device = next(backbone.parameters()).device
        self.score = nn.Linear(hidden_size, 1, device=device)

    def set_sequence_parallel_group(self, group: dist.ProcessGroup | None) -> None:
        """The Ulysses group of the backbone."""
        self.backbone.set_sequence_parallel_group(group)

    def fsdp_units(self) -> list[nn.Module]:
        """The backbone's FSDP2 units (its decoder layers); the head lives in the root unit."""
        return self.backbone.fsdp_units()

    def forward_hidden(self, *, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """Final (normed) hidden states [T_local, H] of this rank's slice of the packed stream."""
        return self.backbone.forward_hidden(
            input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
        )

    def forward(self, *, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """Values [T_local] (fp32) of this rank's slice (head inside forward for FSDP2's root hooks)."""
        hidden = self.forward_hidden(
            input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
        )
        # A copy, not a view of the head's output: FSDP2 warns that a view returned by the root can
        # lose its pre-backward hook under an in-place op (T floats, negligible).
        return self.score(hidden).squeeze(-1).to(torch.float32, copy=True)


def build_value_model(model_config, *, sp_size: int = 1, attn_impl: str = "auto") -> ValueModel:
    """``ValueModel`` over ``build_model(model_config)``; the engine fills the head afterwards."""
    from verl_balance.models import build_model

    return ValueModel(build_model(model_config, sp_size=sp_size, attn_impl=attn_impl))


def checkpoint_has_value_head(path: str) -> bool:
    """Whether the HF directory is a one-label ``*ForTokenClassification`` checkpoint (num_labels != 1: error)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    architectures = config.get("architectures") or []
    if not any(a.endswith("ForTokenClassification") for a in architectures):
        return False
    num_labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    if num_labels != 1:
        from verl_balance.models.config import ModelConfigError

        raise ModelConfigError(
            f"model.path={path!r} is {architectures} with num_labels={num_labels}; a value model needs num_labels=1"
        )
    return True
