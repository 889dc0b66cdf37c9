"""Exact causal attention over packed variable-length sequences, with Ulysses SP inside it.

One function, ``packed_attention``, serves the built-in decoder and every Hugging Face model
(registered with transformers as ``HF_ATTN_IMPLEMENTATION`` by ``register_hf_attention``).

Invariants:
- Token t of sequence i attends to tokens s of sequence i with t - window < s <= t only
  (window = ``sliding_window``, unlimited when None); sequence boundaries come from cu_seqlens,
  never from a mask or position ids. Every token attends at least to itself, so padding, packed
  as its own segment, never produces an all-masked row (no NaN).
- Scores are multiplied by ``scaling`` (default head_dim ** -0.5; HF models pass their own).
- With an SP group of size sp > 1, q/k/v arrive sequence-sharded ([T/sp, H, d], this rank's
  slice of the padded stream) and are exchanged by all-to-all so that attention sees whole
  sequences for H/sp heads, then exchanged back. KV heads fewer than sp are repeated first so
  each rank gets the KV head its contiguous block of query heads is grouped with.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from verl_balance.distributed.ulysses import all_to_all_head_to_seq, all_to_all_seq_to_head
from verl_balance.models.config import ModelConfigError

ATTN_IMPLS = ("auto", "sdpa_masked", "sdpa_loop", "flash_attn")
HF_ATTN_IMPLEMENTATION = "verl_balance_packed"


def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def resolve_attn_impl(impl: str, *, device: torch.device) -> str:
    """Concrete implementation for "auto": flash-attn varlen on CUDA if installed, else a
    per-sequence SDPA loop (fused causal kernels; cost and memory grow with sum(L_i^2), where the
    block-diagonal mask of "sdpa_masked" grows with T^2: 2.5x slower on a heavy-tailed CPU batch,
    benchmarks/hf_bench.py)."""
    if impl not in ATTN_IMPLS:
        raise ModelConfigError(f"attn_impl={impl!r}; valid: {ATTN_IMPLS}")
    if impl != "auto":
        return impl
    if device.type == "cuda" and _flash_attn_varlen() is not None:
        return "flash_attn"
    return "sdpa_loop"


def check_sequence_parallel_heads(*, num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Raise ModelConfigError unless Ulysses with sp_size can split these heads.

    Query heads must divide by sp; KV heads must divide by sp or divide sp (then repeated).
    """
    if sp_size < 1:
        raise ModelConfigError(f"ulysses_sequence_parallel_size={sp_size} must be >= 1")
    if num_heads % sp_size:
        raise ModelConfigError(f"ulysses_sequence_parallel_size={sp_size} must divide num_heads={num_heads}")
    if num_kv_heads % sp_size and sp_size % num_kv_heads:
        raise ModelConfigError(
            f"ulysses_sequence_parallel_size={sp_size} must divide num_kv_heads={num_kv_heads} "
            "or be a multiple of it (kv heads are then repeated)"
        )


def segment_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """Sequence index of each of the `total` packed tokens."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def packed_visibility_mask(cu_seqlens: Tensor, total: int, *, sliding_window: int | None) -> Tensor:
    """Bool [T, T]: query t may attend key s (same sequence, s <= t, t - s < window)."""
    seg = segment_ids(cu_seqlens, total)
    idx = torch.arange(total, device=cu_seqlens.device)
    mask = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    if sliding_window is not None:
        mask &= (idx[:, None] - idx[None, :]) < sliding_window
    return mask


def _masked_sdpa(
    q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, scaling: float, sliding_window: int | None
) -> Tensor:
    # 4-D [1, H, T, d]: a 3-D call makes SDPA fall back to its math kernel on CPU.
    total = q.shape[0]
    mask = packed_visibility_mask(cu_seqlens, total, sliding_window=sliding_window)
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask[None, None], scale=scaling)
    return out.squeeze(0).transpose(0, 1)


def _sdpa_loop(
    q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor, scaling: float, sliding_window: int | None
) -> Tensor:
    outs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        length = end - start
        if sliding_window is not None and length > sliding_window:
            idx = torch.arange(length, device=q.device)
            window = (idx[:, None] >= idx[None, :]) & ((idx[:, None] - idx[None, :]) < sliding_window)
            out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=window[None, None], scale=scaling)
        else:
            out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scaling)
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, dim=0)


def varlen_causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    impl: str = "auto",
    scaling: float | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """Causal attention within each packed sequence on one rank (no SP exchange).

    q: [T, Hq, d]; k, v: [T, Hkv, d] with Hq % Hkv == 0 (GQA: kv head j serves query heads
    j*Hq/Hkv .. (j+1)*Hq/Hkv - 1); cu_seqlens: int [n+1] covering all T tokens. Returns [T, Hq, d].
    """
    total, num_q_heads, head_dim = q.shape
    assert int(cu_seqlens[-1]) == total, "cu_seqlens must cover every packed token"
    scaling = head_dim**-0.5 if scaling is None else float(scaling)
    impl = resolve_attn_impl(impl, device=q.device)
    if impl == "flash_attn":
        cu = cu_seqlens.to(torch.int32)
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        return _flash_attn_varlen()(
            q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True, softmax_scale=scaling, window_size=window
        )
    rep = num_q_heads // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    kernel = _sdpa_loop if impl == "sdpa_loop" else _masked_sdpa
    return kernel(q, k, v, cu_seqlens=cu_seqlens, scaling=scaling, sliding_window=sliding_window)


def packed_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    max_seqlen: int,
    sp_group: dist.ProcessGroup | None = None,
    impl: str = "auto",
    scaling: float | None = None,
    sliding_window: int | None = None,
) -> Tensor:
    """Exact packed causal attention for this rank's slice, Ulysses all-to-all included.

    q: [T_local, Hq, d], k/v: [T_local, Hkv, d] (T_local = T_pad / sp, this rank's slice);
    cu_seqlens spans the full padded stream. Returns [T_local, Hq, d].
    """
    sp = 1 if sp_group is None else dist.get_world_size(sp_group)
    if sp > 1:
        num_kv_heads = k.shape[1]
        check_sequence_parallel_heads(num_heads=q.shape[1], num_kv_heads=num_kv_heads, sp_size=sp)
        if num_kv_heads % sp:
            # sp is a multiple of num_kv_heads: repeat so each SP rank gets one kv head, the one
            # its contiguous block of query heads is grouped with.
            rep = sp // num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = (all_to_all_seq_to_head(z, group=sp_group) for z in (q, k, v))
    out = varlen_causal_attention(
        q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, impl=impl, scaling=scaling, sliding_window=sliding_window
    )
    if sp > 1:
        out = all_to_all_head_to_seq(out, group=sp_group)
    return out


def hf_packed_attention_forward(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    cu_seq_lens_q: Tensor | None = None,
    max_length_q: int | None = None,
    sp_group=None,
    packed_attn_impl: str = "auto",
    **_ignored,
) -> tuple[Tensor, None]:
    """transformers AttentionInterface entry: [1, H, T, d] in, ([1, T, H, d], None) out.

    The boundaries come from ``cu_seq_lens_q`` (passed by ``HFCausalLM.forward``); a call without
    them (e.g. HF's own ``generate``) is an error rather than silently attending across sequences.
    """
    if cu_seq_lens_q is None or max_length_q is None:
        raise ModelConfigError(
            f"attn_implementation={HF_ATTN_IMPLEMENTATION!r} needs cu_seq_lens_q and max_length_q "
            "(call the model through verl_balance.models.hf.HFCausalLM.forward)"
        )
    if dropout:
        raise ModelConfigError(
            f"attention dropout={dropout} is not supported by packed attention; "
            "set attention_dropout=0 in the model config"
        )
    if query.shape[0] != 1:
        raise ModelConfigError(f"packed attention takes one packed row, got batch {query.shape[0]}")
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    out = packed_attention(
        q,
        k,
        v,
        cu_seqlens=cu_seq_lens_q,
        max_seqlen=int(max_length_q),
        sp_group=sp_group,
        impl=packed_attn_impl,
        scaling=scaling,
        sliding_window=sliding_window,
    )
    return out.unsqueeze(0), None


def register_hf_attention() -> str:
    """Register ``hf_packed_attention_forward`` with transformers (idempotent); returns its name.

    No attention-mask function is registered for it, so HF models build no mask (None) and
    never run their packed-sequence detection; the boundaries are cu_seqlens only.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTN_IMPLEMENTATION, hf_packed_attention_forward)
    return HF_ATTN_IMPLEMENTATION
