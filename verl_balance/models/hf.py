"""Hugging Face causal LMs (see SUPPORTED_MODEL_TYPES) behind ``PackedCausalLM``.

Invariants:
- Parameter names are exactly HF's, so ``state_dict()`` loads into ``AutoModelForCausalLM``
  unchanged and vice versa.
- Tied embeddings stay one Parameter, in the FSDP2 root unit, so sharding keeps them tied.
- Boundaries come from cu_seqlens only (``attention_mask=None``, ``use_cache=False``).
- ``forward`` returns exactly HF's logits (``self.logit_transform``).
- A family feature packed attention cannot honour is refused at start-up
  (``check_family_features``) or at call time. Nothing is dropped.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from verl_balance.balance.workload import mla_query_head_dim, moe_dimensions
from verl_balance.models.attention import (
    HF_ATTN_IMPLEMENTATION,
    check_sequence_parallel_heads,
    register_hf_attention,
)
from verl_balance.models.config import ModelConfigError
from verl_balance.models.output_head import LogitTransform, Temperature, head_token_log_probs, head_token_stats

# Each has a tiny variant in tests/models/_tiny_variants.py whose packed logits equal HF's.
SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "deepseek_v2",
)
# Model types users bring that are refused, with the reason (the error names it).
REFUSED_MODEL_TYPES = {
    "gemma3": "the multimodal Gemma3ForConditionalGeneration; save its language model "
    "(Gemma3ForCausalLM, model_type gemma3_text) and point model.path at that",
    "deepseek_v3": "its router (sigmoid scores with e_score_correction_bias, noaux_tc) is not tested "
    "here yet; deepseek_v2 (DeepSeek-V2/V2-Lite) is supported",
}
INIT_MODES = ("pretrained", "random")
# RoPE types whose frequencies HF recomputes from max(position_ids) of the whole call: packed, that
# is the longest sequence of the micro-batch, so they are exact only up to the original length.
LENGTH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


def _effective_sliding_window(hf_config) -> int | None:
    """The window any layer uses (None: full attention everywhere), as the HF modules apply it."""
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if hf_config.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not getattr(
        hf_config, "use_sliding_window", False
    ):
        return None
    return int(window)


def check_family_features(hf_config, *, path: str) -> None:
    """Raise ModelConfigError naming the model type and key of a feature packing cannot reproduce exactly."""
    model_type = hf_config.model_type

    def refuse(key: str, why: str) -> None:
        raise ModelConfigError(f"model.path={path!r} (model_type={model_type}) sets {key}: {why}")

    if getattr(hf_config, "attention_dropout", 0.0):
        refuse(f"attention_dropout={hf_config.attention_dropout}", "packed attention supports 0 only")
    if getattr(hf_config, "use_bidirectional_attention", False):
        refuse("use_bidirectional_attention=true", "packed attention is causal only")
    if getattr(hf_config, "router_jitter_noise", 0.0):
        refuse(
            f"router_jitter_noise={hf_config.router_jitter_noise}",
            "random routing noise in training makes the loss depend on the layout; set it to 0",
        )
    if model_type == "qwen2_moe" and getattr(hf_config, "use_sliding_window", False):
        refuse("use_sliding_window=true", "HF's Qwen2-MoE attention does not pass its window to the attention function")


def rope_length_limit(hf_config) -> int | None:
    """Longest packed sequence a length-dependent RoPE is exact for; None when every RoPE is fixed."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    per_layer = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    limits = [
        int(p.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
        for p in per_layer
        if any(t in str(p.get("rope_type", p.get("type", ""))) for t in LENGTH_DEPENDENT_ROPE_TYPES)
    ]
    return min(limits) if limits else None


def load_hf_config(path: str):
    """A fresh transformers config from ``path``/config.json (local only); checks the family."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ModelConfigError(
            f"model.path={path!r} has no config.json; it must be a local Hugging Face "
            "model directory (save_pretrained output); nothing is downloaded"
        )
    with open(config_file) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = REFUSED_MODEL_TYPES.get(model_type, "")
        raise ModelConfigError(
            f"model.path={path!r} has model_type={model_type!r}{'; ' + why if why else ''}; "
            f"supported model types: {SUPPORTED_MODEL_TYPES}"
        )
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    check_family_features(hf_config, path=path)
    return hf_config


@dataclass(frozen=True)
class HFModelConfig:
    """Dimensions of a local Hugging Face causal LM plus how to build it (``init``: "pretrained" loads
    the directory's weights, "random" draws from torch's RNG; MoE fields are 0 / None when dense)."""

    path: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None = None
    init: str = "pretrained"
    enable_gradient_checkpointing: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int = 0
    num_moe_layers: int | None = None

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelConfigError(f"model_type={self.model_type!r} is not supported; valid: {SUPPORTED_MODEL_TYPES}")
        if self.init not in INIT_MODES:
            raise ModelConfigError(f"model.init={self.init!r}; valid: {INIT_MODES}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")

    @classmethod
    def from_pretrained(
        cls, path: str, *, init: str = "pretrained", enable_gradient_checkpointing: bool = False
    ) -> HFModelConfig:
        """Read ``path``/config.json; any model_type outside SUPPORTED_MODEL_TYPES is an error."""
        path = os.path.abspath(os.path.expanduser(path))
        hf = load_hf_config(path)
        head_dim = mla_query_head_dim(hf) or getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            path=path,
            model_type=hf.model_type,
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            intermediate_size=int(hf.intermediate_size),
            num_layers=int(hf.num_hidden_layers),
            num_heads=int(hf.num_attention_heads),
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            sliding_window=_effective_sliding_window(hf),
            init=init,
            enable_gradient_checkpointing=bool(enable_gradient_checkpointing),
            **moe_dimensions(hf),
        )

    def hf_config(self):
        """A fresh transformers config object (never shared between two models)."""
        return load_hf_config(self.path)

    def to_dict(self) -> dict:
        """Plain dict of the fields (for logging and checkpoints)."""
        return asdict(self)


def build_hf_model(config: HFModelConfig, *, attn_implementation: str = "sdpa"):
    """A plain fp32 ``AutoModelForCausalLM`` (pretrained or random), built from its own config copy."""
    from transformers import AutoModelForCausalLM

    if attn_implementation == HF_ATTN_IMPLEMENTATION:
        register_hf_attention()
    hf_config = copy.deepcopy(config.hf_config())
    attn_implementation = exact_hf_attention(attn_implementation, hf_config)
    if config.init == "pretrained":
        return AutoModelForCausalLM.from_pretrained(
            config.path,
            config=hf_config,
            local_files_only=True,
            dtype=torch.float32,
            attn_implementation=attn_implementation,
        )
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, attn_implementation=attn_implementation)


def exact_hf_attention(requested: str, hf_config) -> str:
    """ "eager" for a soft-capped model asked for "sdpa" (HF's sdpa silently drops ``softcap``)."""
    if requested == "sdpa" and getattr(hf_config, "attn_logit_softcapping", None):
        return "eager"
    return requested


class HFCausalLM(nn.Module):
    """An HF causal LM over one packed token stream (see module docstring for the invariants)."""

    def __init__(self, config: HFModelConfig, *, sp_size: int = 1, attn_impl: str = "auto"):
        super().__init__()
        check_sequence_parallel_heads(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, sp_size=sp_size)
        self.config, self.sp_size, self.attn_impl = config, sp_size, attn_impl
        self.sp_group: dist.ProcessGroup | None = None
        hf_model = build_hf_model(config, attn_implementation=HF_ATTN_IMPLEMENTATION)
        if config.enable_gradient_checkpointing:
            hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        if getattr(self.lm_head, "bias", None) is not None:
            raise ModelConfigError(f"model.path={config.path!r}: an output projection with a bias is not supported")
        self.logit_transform = LogitTransform.from_hf_config(hf_model.config)
        self.rope_length_limit = rope_length_limit(hf_model.config)
        # Not a submodule: registering it would prefix every parameter name with "hf_model.".
        object.__setattr__(self, "hf_model", hf_model)
        if config.tie_word_embeddings:
            assert self.lm_head.weight is self.model.embed_tokens.weight, "HF did not tie the embeddings"

    def set_sequence_parallel_group(self, group: dist.ProcessGroup | None) -> None:
        """The Ulysses group; its size must equal the sp_size the model was built for."""
        size = 1 if group is None else dist.get_world_size(group)
        if size != self.sp_size:
            raise ModelConfigError(f"SP group has {size} ranks, model was built for sp_size={self.sp_size}")
        self.sp_group = group if size > 1 else None

    def fsdp_units(self) -> list[nn.Module]:
        """The modules named in HF's ``_no_split_modules`` (the decoder layers)."""
        names = set(getattr(self.hf_model, "_no_split_modules", None) or ())
        units = [m for m in self.model.modules() if type(m).__name__ in names]
        assert units, f"no module of {sorted(names)} found in {type(self.hf_model).__name__}"
        return units

    def output_weight(self) -> Tensor:
        """The output projection [V, H] (``lm_head.weight``; the embedding when tied)."""
        return self.lm_head.weight

    def forward_hidden(self, *, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """Final (normed) hidden states [T_local, H] of this rank's slice of the packed stream."""
        if self.rope_length_limit is not None and int(max_seqlen) > self.rope_length_limit:
            raise ModelConfigError(
                f"{self.config.model_type} at {self.config.path!r}: a sequence of {int(max_seqlen)} tokens exceeds "
                f"original_max_position_embeddings={self.rope_length_limit} of its length-dependent RoPE "
                f"({LENGTH_DEPENDENT_ROPE_TYPES}); HF rescales it by the longest sequence of the call, so packed "
                "sequences would change each other's positions; cap the sequence length at that limit"
            )
        out = self.model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask=None,
            use_cache=False,
            cu_seq_lens_q=cu_seqlens,
            cu_seq_lens_k=cu_seqlens,
            max_length_q=int(max_seqlen),
            max_length_k=int(max_seqlen),
            sp_group=self.sp_group,
            packed_attn_impl=self.attn_impl,
            **({"output_router_logits": False} if self.config.num_experts else {}),
        )
        return out.last_hidden_state[0]

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
        """Logits [T_local, V] of this rank's slice; with ``targets``, (log p(target), entropy or None)."""
        hidden = self.forward_hidden(
            input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
        )
        if targets is None:
            return self.logit_transform.apply(self.lm_head(hidden))
        if with_sum_pi_squared:  # no-grad log-prob pass of the optimal-token baselines
            return head_token_stats(
                hidden,
                self.output_weight(),
                targets,
                transform=self.logit_transform,
                temperature=temperature,
                chunk_size=logits_chunk_size,
            )
        return head_token_log_probs(
            hidden,
            self.output_weight(),
            targets,
            transform=self.logit_transform,
            temperature=temperature,
            with_entropy=with_entropy,
            chunk_size=logits_chunk_size,
        )
