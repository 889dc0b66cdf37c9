"""Exact causal attention over packed variable-length sequences.

Invariant: token t of sequence i attends to tokens s <= t of sequence i only (sequence boundaries
from cu_seqlens); no attention across boundaries. Every token attends at least to itself, so
padding, packed as its own segment, never produces an all-masked row (no NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ATTN_IMPLS = ("auto", "sdpa_masked", "sdpa_loop", "flash_attn")


def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def resolve_attn_impl(impl: str, *, device: torch.device) -> str:
    """Concrete implementation for "auto": flash-attn varlen on CUDA if installed, else a
    per-sequence SDPA loop on CUDA (fused kernels), else a block-diagonal-masked SDPA on CPU."""
    if impl not in ATTN_IMPLS:
        raise ValueError(f"attn_impl={impl!r}; valid: {ATTN_IMPLS}")
    if impl != "auto":
        return impl
    if device.type == "cuda":
        return "flash_attn" if _flash_attn_varlen() is not None else "sdpa_loop"
    return "sdpa_masked"


def segment_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """Sequence index of each of the `total` packed tokens."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths,
                                   output_size=total)


def varlen_causal_attention(q: Tensor, k: Tensor, v: Tensor, *, cu_seqlens: Tensor,
                            max_seqlen: int, impl: str = "auto") -> Tensor:
    """Causal attention within each packed sequence.

    q: [T, Hq, d]; k, v: [T, Hkv, d] with Hq % Hkv == 0 (GQA: kv head j serves query heads
    j*Hq/Hkv .. (j+1)*Hq/Hkv - 1); cu_seqlens: int [n+1] covering all T tokens. Returns [T, Hq, d].
    """
    total, num_q_heads, head_dim = q.shape
    assert int(cu_seqlens[-1]) == total, "cu_seqlens must cover every packed token"
    impl = resolve_attn_impl(impl, device=q.device)
    if impl == "flash_attn":
        cu = cu_seqlens.to(torch.int32)
        return _flash_attn_varlen()(q, k, v, cu, cu, max_seqlen, max_seqlen, causal=True)
    rep = num_q_heads // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if impl == "sdpa_loop":
        outs = []
        bounds = cu_seqlens.tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            qi, ki, vi = (x[start:end].transpose(0, 1) for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True).transpose(0, 1))
        return torch.cat(outs, dim=0)
    seg = segment_ids(cu_seqlens, total)
    idx = torch.arange(total, device=q.device)
    mask = (seg[:, None] == seg[None, :]) & (idx[:, None] >= idx[None, :])
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask)
    return out.transpose(0, 1)
