"""Built-in Llama-style decoder over packed, padding-free batches, with Ulysses SP around attention.

Invariants:
- Parameter names are a contract (docs/models.md); HF-Llama math.
- Input: input_ids / position_ids [T_local] (this rank's SP slice), cu_seqlens over the full
  padded stream; only attention exchanges (all-to-all), everything else is token-local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from verl_balance.models.attention import check_sequence_parallel_heads, packed_attention
from verl_balance.models.config import ModelConfig, ModelConfigError
from verl_balance.models.output_head import LogitTransform, Temperature, head_token_log_probs, head_token_stats


def check_sequence_parallel(config: ModelConfig, sp_size: int) -> None:
    """Raise ModelConfigError unless Ulysses with sp_size can split the heads of `config`."""
    check_sequence_parallel_heads(num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, sp_size=sp_size)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * x * rsqrt(mean(x^2) + eps), normalized in fp32 and cast back (HF-Llama)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """y = weight * x * rsqrt(mean(x^2) + eps), normalized in fp32 (HF-Llama)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rotary_cos_sin(position_ids: Tensor, *, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin of shape position_ids.shape + (head_dim,) for HF rotate_half RoPE (frequencies in fp32)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    )
    freqs = position_ids.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] on the last dimension (HF-Llama RoPE convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class Attention(nn.Module):
    """GQA self-attention; Ulysses all-to-all around the varlen kernel when sp > 1."""

    def __init__(self, config: ModelConfig, *, sp_size: int, attn_impl: str):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.sp_size, self.attn_impl = sp_size, attn_impl
        h, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)

    def forward(
        self,
        x: Tensor,
        *,
        cos: Tensor,
        sin: Tensor,
        cu_seqlens: Tensor,
        max_seqlen: int,
        sp_group: dist.ProcessGroup | None,
    ) -> Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = packed_attention(
            q,
            k,
            v,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            sp_group=sp_group if self.sp_size > 1 else None,
            impl=self.attn_impl,
        )
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(input_norm(x)), then + mlp(post_attn_norm(x)).
    ``gradient_checkpointing`` recomputes the block in the backward, inside FSDP2's hooks."""

    def __init__(self, config: ModelConfig, *, sp_size: int, attn_impl: str):
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, sp_size=sp_size, attn_impl=attn_impl)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        self.gradient_checkpointing = config.enable_gradient_checkpointing

    def forward(self, x: Tensor, **attn_kwargs) -> Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._block, x, use_reentrant=False, **attn_kwargs)
        return self._block(x, **attn_kwargs)

    def _block(self, x: Tensor, **attn_kwargs) -> Tensor:
        x = x + self.attn(self.input_norm(x), **attn_kwargs)
        return x + self.mlp(self.post_attn_norm(x))


class LlamaForCausalLM(nn.Module):
    """Llama-style causal LM over one packed token stream (see module docstring)."""

    def __init__(self, config: ModelConfig, *, sp_size: int = 1, attn_impl: str = "auto"):
        super().__init__()
        check_sequence_parallel(config, sp_size)
        self.config, self.sp_size = config, sp_size
        self.sp_group: dist.ProcessGroup | None = None
        self.logit_transform = LogitTransform()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, sp_size=sp_size, attn_impl=attn_impl) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Normal(0, initializer_range) for matrices, ones for norms (draws from torch's RNG)."""
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            else:
                nn.init.normal_(param, mean=0.0, std=self.config.initializer_range)

    def set_sequence_parallel_group(self, group: dist.ProcessGroup | None) -> None:
        """The Ulysses group; its size must equal the sp_size the model was built for."""
        size = 1 if group is None else dist.get_world_size(group)
        if size != self.sp_size:
            raise ModelConfigError(f"SP group has {size} ranks, model was built for sp_size={self.sp_size}")
        self.sp_group = group

    def fsdp_units(self) -> list[nn.Module]:
        """Submodules to shard as separate FSDP2 units (the root is sharded last)."""
        return list(self.layers)

    def output_weight(self) -> Tensor:
        """The output projection [V, H] (the embedding when tie_word_embeddings)."""
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward_hidden(self, *, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """Final (normed) hidden states [T_local, H] of this rank's slice of the packed stream."""
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_cos_sin(
            position_ids, head_dim=self.config.head_dim, theta=self.config.rope_theta, dtype=x.dtype
        )
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, head_dim]: broadcast over heads
        for layer in self.layers:
            x = layer(x, cos=cos, sin=sin, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, sp_group=self.sp_group)
        return self.norm(x)

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
            return self.logit_transform.apply(F.linear(hidden, self.output_weight()))
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
