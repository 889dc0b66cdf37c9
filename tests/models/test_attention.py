"""packed_attention: brute-force reference for scaling, sliding window, GQA and both SDPA kernels."""

from __future__ import annotations

import math

import pytest
import torch

from verl_balance.models.attention import ATTN_IMPLS, packed_attention, resolve_attn_impl
from verl_balance.models.config import ModelConfigError


def brute_force(q, k, v, lengths, *, scaling, window, softcap=None):
    """Per sequence, per head, per query: softmax over the visible keys, written out by hand."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    start = 0
    for length in lengths:
        for head in range(q.shape[1]):
            for t in range(length):
                lo = 0 if window is None else max(0, t - window + 1)
                keys = k[start + lo : start + t + 1, head // group]
                scores = keys @ q[start + t, head] * scaling
                if softcap is not None:
                    scores = softcap * torch.tanh(scores / softcap)
                out[start + t, head] = torch.softmax(scores, 0) @ v[start + lo : start + t + 1, head // group]
        start += length
    return out


@pytest.mark.parametrize("impl", ["sdpa_masked", "sdpa_loop"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("scaling", [None, 0.37])
def test_packed_attention_equals_brute_force(impl, window, scaling):
    torch.manual_seed(0)
    lengths = [4, 1, 7, 2]
    q = torch.randn(sum(lengths), 4, 8)
    k, v = torch.randn(sum(lengths), 2, 8), torch.randn(sum(lengths), 2, 8)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    got = packed_attention(
        q, k, v, cu_seqlens=cu, max_seqlen=max(lengths), impl=impl, scaling=scaling, sliding_window=window
    )
    expected = brute_force(q, k, v, lengths, scaling=1 / math.sqrt(8) if scaling is None else scaling, window=window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    # Negative control: the default scaling differs from 0.37, the full window from 3.
    if scaling is not None or window is not None:
        plain = packed_attention(q, k, v, cu_seqlens=cu, max_seqlen=max(lengths), impl=impl)
        assert not torch.allclose(plain, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["sdpa_masked", "sdpa_loop"])
@pytest.mark.parametrize("window", [None, 3])
def test_soft_capped_attention_equals_brute_force(impl, window):
    torch.manual_seed(0)
    lengths = [4, 1, 7, 2]
    q = 3 * torch.randn(sum(lengths), 4, 8)  # large scores, so the cap matters
    k, v = torch.randn(sum(lengths), 2, 8), torch.randn(sum(lengths), 2, 8)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    kw = dict(cu_seqlens=cu, max_seqlen=max(lengths), impl=impl, scaling=0.5, sliding_window=window)
    got = packed_attention(q, k, v, softcap=2.0, **kw)
    expected = brute_force(q, k, v, lengths, scaling=0.5, window=window, softcap=2.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(packed_attention(q, k, v, **kw), expected, rtol=1e-5, atol=1e-6)  # cap dropped


@pytest.mark.parametrize("impl", ["sdpa_masked", "sdpa_loop"])
def test_packed_attention_gradients_equal_brute_force(impl):
    """Backward through the packed kernels (a zero-length sequence included) matches autograd through
    the hand-written reference, for q, k and v."""
    torch.manual_seed(0)
    lengths = [4, 0, 7, 1, 2]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    inputs = [torch.randn(sum(lengths), h, 8, dtype=torch.float64) for h in (4, 2, 2)]
    upstream = torch.randn(sum(lengths), 4, 8, dtype=torch.float64)
    grads = []
    for fn in (
        lambda q, k, v: packed_attention(q, k, v, cu_seqlens=cu, max_seqlen=max(lengths), impl=impl),
        lambda q, k, v: brute_force(q, k, v, lengths, scaling=1 / math.sqrt(8), window=None),
    ):
        leaves = [x.clone().requires_grad_() for x in inputs]
        (fn(*leaves) * upstream).sum().backward()
        grads.append([x.grad for x in leaves])
    for got, expected in zip(*grads):
        torch.testing.assert_close(got, expected)
    # Negative control: another upstream gradient gives other input gradients.
    leaves = [x.clone().requires_grad_() for x in inputs]
    packed_attention(*leaves, cu_seqlens=cu, max_seqlen=max(lengths), impl=impl).sum().backward()
    assert not torch.allclose(leaves[0].grad, grads[1][0])


def test_unknown_impl_is_a_config_error_listing_the_valid_ones():
    with pytest.raises(ModelConfigError, match="sdpa_masked"):
        resolve_attn_impl("xformers", device=torch.device("cpu"))
    assert resolve_attn_impl("auto", device=torch.device("cpu")) in ATTN_IMPLS


def test_grouped_sdpa_equals_hf_sdpa_under_a_padding_mask_and_refuses_what_it_cannot_honour():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from verl_balance.models.attention import grouped_sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 3
    gen = torch.Generator().manual_seed(0)
    for q_len in (5, 1):  # prefill, decode
        q = torch.randn(2, 6, q_len, 8, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(2, 2, 5, 8, generator=gen, dtype=torch.float64) for _ in range(2))
        mask = torch.ones(2, 1, q_len, 5, dtype=torch.bool).tril(diagonal=5 - q_len)
        mask[0, ..., :2] = False  # row 0 left-padded by two
        expected = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)[0]
        got = grouped_sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)[0]
        torch.testing.assert_close(got, expected)
        unmasked = grouped_sdpa_attention_forward(module, q, k, v, torch.ones_like(mask), scaling=0.3)[0]
        assert not torch.allclose(unmasked[0], expected[0])  # negative control: the padding mask matters
    with pytest.raises(ModelConfigError, match="position_bias"):
        grouped_sdpa_attention_forward(module, q, k, v, mask, position_bias=torch.zeros(1))
