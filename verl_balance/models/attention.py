"""Exact causal attention over packed variable-length sequences, with Ulysses SP inside it.

Invariants:
- Token t of sequence i attends to tokens s of sequence i with t - window < s <= t only
  (window = ``sliding_window``, unlimited when None); boundaries come from cu_seqlens only, and no
  row is all-masked (no NaN).
- Scores: times ``scaling`` (default head_dim ** -0.5), soft-capped when ``softcap`` is set, then
  mask and softmax: HF eager's order.
- The HF entry point refuses any attention argument it does not honour.
- With sp > 1, q/k/v arrive sequence-sharded ([T/sp, H, d]); an all-to-all gives each rank whole
  sequences for H/sp heads, then back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from verl_balance.distributed.ulysses import all_to_all_head_to_seq, all_to_all_seq_to_head_together
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
    """ "auto": flash-attn varlen on CUDA if installed, else the per-sequence SDPA loop."""
    if impl not in ATTN_IMPLS:
        raise ModelConfigError(f"attn_impl={impl!r}; valid: {ATTN_IMPLS}")
    if impl != "auto":
        return impl
    if device.type == "cuda" and _flash_attn_varlen() is not None:
        return "flash_attn"
    return "sdpa_loop"


def check_sequence_parallel_heads(*, num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Raise ModelConfigError unless query heads divide by sp and KV heads divide sp or by it."""
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


def _softcapped_attention(
    q4: Tensor, k4: Tensor, v4: Tensor, *, mask: Tensor, scaling: float, softcap: float
) -> Tensor:
    """[1, H, T, d] attention in HF eager's order: scale -> cap -> mask -> fp32 softmax."""
    scores = torch.matmul(q4, k4.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q4.dtype)
    return torch.matmul(probs, v4)


def _attend(
    q4: Tensor, k4: Tensor, v4: Tensor, *, mask: Tensor | None, scaling: float, softcap: float | None
) -> Tensor:
    """[1, H, T, d] attention under a boolean visibility mask (None: plain causal)."""
    if softcap is not None:
        if mask is None:
            idx = torch.arange(q4.shape[2], device=q4.device)
            mask = idx[:, None] >= idx[None, :]
        return _softcapped_attention(q4, k4, v4, mask=mask, scaling=scaling, softcap=softcap)
    if mask is None:
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scaling)
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask[None, None], scale=scaling)


def _masked_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> Tensor:
    # 4-D [1, H, T, d]: a 3-D call makes SDPA fall back to its math kernel on CPU.
    total = q.shape[0]
    mask = packed_visibility_mask(cu_seqlens, total, sliding_window=sliding_window)
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    out = _attend(q4, k4, v4, mask=mask, scaling=scaling, softcap=softcap)
    return out.squeeze(0).transpose(0, 1)


def _sdpa_loop(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    scaling: float,
    sliding_window: int | None,
    softcap: float | None,
) -> Tensor:
    outs = []
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    # One split per tensor: its backward is one cat, where per-sequence slices would each
    # scatter into a zero tensor of the whole stream (quadratic in the number of sequences).
    for qi, ki, vi, length in zip(q.split(lengths), k.split(lengths), v.split(lengths), lengths):
        qi, ki, vi = (x.transpose(0, 1).unsqueeze(0) for x in (qi, ki, vi))
        window = None
        if sliding_window is not None and length > sliding_window:
            idx = torch.arange(length, device=q.device)
            window = (idx[:, None] >= idx[None, :]) & ((idx[:, None] - idx[None, :]) < sliding_window)
        out = _attend(qi, ki, vi, mask=window, scaling=scaling, softcap=softcap)
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
    softcap: float | None = None,
) -> Tensor:
    """Causal attention within each packed sequence on one rank (no SP exchange).
    q: [T, Hq, d]; k, v: [T, Hkv, d], Hq % Hkv == 0; cu_seqlens: int [n+1]. Returns [T, Hq, d_v]."""
    total, num_q_heads, head_dim = q.shape
    assert int(cu_seqlens[-1]) == total, "cu_seqlens must cover every packed token"
    scaling = head_dim**-0.5 if scaling is None else float(scaling)
    impl = resolve_attn_impl(impl, device=q.device)
    if impl == "flash_attn":
        if v.shape[-1] < head_dim:  # DeepSeek MLA: flash-attn wants one head size; pad v, cut the output
            out = varlen_causal_attention(
                q,
                k,
                F.pad(v, (0, head_dim - v.shape[-1])),
                cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen,
                impl=impl,
                scaling=scaling,
                sliding_window=sliding_window,
                softcap=softcap,
            )
            return out[..., : v.shape[-1]]
        cu = cu_seqlens.to(torch.int32)
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        # flash-attn < 2.6 has no softcap argument: pass it only when the model caps.
        capping = {} if softcap is None else {"softcap": float(softcap)}
        return _flash_attn_varlen()(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen,
            max_seqlen,
            causal=True,
            softmax_scale=scaling,
            window_size=window,
            **capping,
        )
    rep = num_q_heads // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    kernel = _sdpa_loop if impl == "sdpa_loop" else _masked_sdpa
    return kernel(q, k, v, cu_seqlens=cu_seqlens, scaling=scaling, sliding_window=sliding_window, softcap=softcap)


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
    softcap: float | None = None,
) -> Tensor:
    """Exact packed causal attention for this rank's slice, Ulysses all-to-all included (collective).
    q: [T_local, Hq, d], k/v: [T_local, Hkv, d]; cu_seqlens spans the full padded stream."""
    sp = 1 if sp_group is None else dist.get_world_size(sp_group)
    if sp > 1:
        num_kv_heads = k.shape[1]
        check_sequence_parallel_heads(num_heads=q.shape[1], num_kv_heads=num_kv_heads, sp_size=sp)
        if num_kv_heads % sp:
            # sp is a multiple of num_kv_heads: repeat so each SP rank gets one kv head, the one
            # its contiguous block of query heads is grouped with.
            rep = sp // num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = all_to_all_seq_to_head_together(q, k, v, group=sp_group)
    out = varlen_causal_attention(
        q,
        k,
        v,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        impl=impl,
        scaling=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
    )
    if sp > 1:
        out = all_to_all_head_to_seq(out, group=sp_group)
    return out


# Keywords HF passes to every attention function that carry no attention semantics of their own
# (the mask and boundaries come from cu_seqlens here); every other keyword must be honoured or None.
_HF_PASSTHROUGH_KWARGS = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache_position",
        "output_attentions",
        "output_router_logits",
        "output_hidden_states",
        "cu_seq_lens_k",
        "max_length_k",
        "is_causal",
        "layer_type",
        "position_embeddings",
    }
)


def _check_hf_attention_call(module, *, dropout: float, batch: int, extra: dict) -> None:
    """Refuse what packed attention cannot honour, naming the module and the feature."""
    where = type(module).__name__
    if dropout:
        raise ModelConfigError(
            f"{where}: attention dropout={dropout} is not supported by packed attention; "
            "set attention_dropout=0 in the model config"
        )
    if batch != 1:
        raise ModelConfigError(f"packed attention takes one packed row, got batch {batch}")
    if not getattr(module, "is_causal", True) or extra.get("is_causal") is False:
        raise ModelConfigError(f"{where} is not causal (bidirectional attention); packed attention is causal only")
    unknown = sorted(k for k, v in extra.items() if k not in _HF_PASSTHROUGH_KWARGS and v is not None)
    if unknown:
        raise ModelConfigError(
            f"{where} passes attention argument(s) {unknown} that packed attention does not implement "
            "(supported: scaling, sliding_window, softcap); this model cannot be trained exactly"
        )


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
    softcap: float | None = None,
    cu_seq_lens_q: Tensor | None = None,
    max_length_q: int | None = None,
    sp_group=None,
    packed_attn_impl: str = "auto",
    **extra,
) -> tuple[Tensor, None]:
    """transformers AttentionInterface entry: [1, H, T, d] in, ([1, T, H, d], None) out; a call without
    ``cu_seq_lens_q`` is an error."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ModelConfigError(
            f"attn_implementation={HF_ATTN_IMPLEMENTATION!r} needs cu_seq_lens_q and max_length_q "
            "(call the model through verl_balance.models.hf.HFCausalLM.forward)"
        )
    _check_hf_attention_call(module, dropout=dropout, batch=query.shape[0], extra=extra)
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
        softcap=softcap,
    )
    return out.unsqueeze(0), None


def register_hf_attention() -> str:
    """Register ``hf_packed_attention_forward`` (idempotent, no mask function); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTN_IMPLEMENTATION, hf_packed_attention_forward)
    return HF_ATTN_IMPLEMENTATION


GROUPED_SDPA_ATTN_IMPLEMENTATION = "verl_balance_grouped_sdpa"
_GROUPED_SDPA_KWARGS = _HF_PASSTHROUGH_KWARGS | {"sliding_window"}  # the window is in HF's sdpa mask


def grouped_sdpa_attention_forward(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """HF's ``sdpa`` attention ([B, H, q, d] in, ([B, q, H, d], None) out; HF's sdpa mask) with grouped
    KV heads handed to SDPA as they are (``enable_gqa``), where HF's sdpa repeats them under a mask (transformers
    5.10 at every step, later versions in prefill): the same values, without copying each layer's KV cache.
    Refuses any other argument that is not None, as the packed entry point does."""
    unknown = sorted(k for k, v in kwargs.items() if k not in _GROUPED_SDPA_KWARGS and v is not None)
    if unknown:
        raise ModelConfigError(
            f"{type(module).__name__} passes attention argument(s) {unknown} that "
            f"{GROUPED_SDPA_ATTN_IMPLEMENTATION} does not implement; this model needs HF's own attention"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=bool(query.shape[2] > 1 and attention_mask is None and causal),
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def use_grouped_sdpa(hf_model) -> bool:
    """Switch an HF model built with ``sdpa`` to ``grouped_sdpa_attention_forward`` (HF's sdpa mask);
    False, unchanged, for any other attention. For CPU decoding: CUDA's fused SDPA kernels take no mask
    with grouped heads, so HF's own repeat stays faster there."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if hf_model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(GROUPED_SDPA_ATTN_IMPLEMENTATION, grouped_sdpa_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_SDPA_ATTN_IMPLEMENTATION, sdpa_mask)
    hf_model.set_attn_implementation(GROUPED_SDPA_ATTN_IMPLEMENTATION)
    return hf_model.config._attn_implementation == GROUPED_SDPA_ATTN_IMPLEMENTATION
