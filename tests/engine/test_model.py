"""Built-in decoder: parameter-name contract, exact packed attention, HF-Llama math, SP checks."""

import math

import pytest
import torch

from verl_balance.models import LlamaForCausalLM, ModelConfig, ModelConfigError, build_model
from verl_balance.models.attention import varlen_causal_attention

TINY = ModelConfig.preset("tiny")


def contract_names(cfg: ModelConfig) -> set[str]:
    names = {"embed_tokens.weight", "norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        names |= {
            f"layers.{i}.{n}.weight"
            for n in (
                "input_norm",
                "attn.q_proj",
                "attn.k_proj",
                "attn.v_proj",
                "attn.o_proj",
                "post_attn_norm",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        }
    return names


@pytest.mark.parametrize("tie", [False, True])
def test_state_dict_names_and_shapes_follow_the_contract(tie):
    cfg = ModelConfig(**{**TINY.to_dict(), "tie_word_embeddings": tie})
    sd = LlamaForCausalLM(cfg).state_dict()
    assert set(sd) == contract_names(cfg)
    h, hd, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    assert sd["layers.0.attn.q_proj.weight"].shape == (cfg.num_heads * hd, h)
    assert sd["layers.0.attn.k_proj.weight"].shape == (cfg.num_kv_heads * hd, h)
    assert sd["layers.0.attn.o_proj.weight"].shape == (h, cfg.num_heads * hd)
    assert sd["layers.0.mlp.down_proj.weight"].shape == (h, f)
    assert sd["embed_tokens.weight"].shape == (cfg.vocab_size, h)


def naive_llama_logits(sd: dict, cfg: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Independent re-derivation of the contract math for ONE sequence (positions 0..L-1)."""
    length, hd = len(ids), cfg.head_dim
    x = sd["embed_tokens.weight"][ids]

    def rms(v, w):
        return w * (v / torch.sqrt((v * v).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    def rope(v):  # v [L, heads, hd]; pairs (j, j + hd/2) rotated by pos * theta^(-2j/hd)
        out = v.clone()
        for j in range(hd // 2):
            ang = torch.arange(length, dtype=torch.float32) * cfg.rope_theta ** (-2 * j / hd)
            c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
            a, b = v[..., j], v[..., j + hd // 2]
            out[..., j], out[..., j + hd // 2] = a * c - b * s, b * c + a * s
        return out

    group = cfg.num_heads // cfg.num_kv_heads
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        h = rms(x, sd[p + "input_norm.weight"])
        q = rope((h @ sd[p + "attn.q_proj.weight"].T).view(length, cfg.num_heads, hd))
        k = rope((h @ sd[p + "attn.k_proj.weight"].T).view(length, cfg.num_kv_heads, hd))
        v = (h @ sd[p + "attn.v_proj.weight"].T).view(length, cfg.num_kv_heads, hd)
        heads = []
        for head in range(cfg.num_heads):
            kv = head // group
            scores = (q[:, head] @ k[:, kv].T) / math.sqrt(hd)
            scores = scores.masked_fill(~causal, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v[:, kv])
        x = x + torch.cat(heads, -1) @ sd[p + "attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attn_norm.weight"])
        gate, up = h @ sd[p + "mlp.gate_proj.weight"].T, h @ sd[p + "mlp.up_proj.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    x = rms(x, sd["norm.weight"])
    head_w = sd["embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return x @ head_w.T


@pytest.mark.parametrize("tie", [False, True])
def test_forward_matches_naive_llama_math(tie):
    cfg = ModelConfig(**{**TINY.to_dict(), "tie_word_embeddings": tie, "rope_theta": 500.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (11,))
    logits = model(input_ids=ids, position_ids=torch.arange(11), cu_seqlens=torch.tensor([0, 11]), max_seqlen=11)
    expected = naive_llama_logits({k: v.detach() for k, v in model.state_dict().items()}, cfg, ids)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa_masked", "sdpa_loop"])
def test_packed_forward_equals_per_sequence_forward(impl):
    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY, attn_impl=impl)
    lengths = [5, 1, 9, 3]
    seqs = [torch.randint(0, TINY.vocab_size, (n,)) for n in lengths]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    packed = model(
        input_ids=torch.cat(seqs),
        cu_seqlens=cu,
        max_seqlen=max(lengths),
        position_ids=torch.cat([torch.arange(n) for n in lengths]),
    )
    for i, seq in enumerate(seqs):
        alone = model(
            input_ids=seq,
            position_ids=torch.arange(len(seq)),
            cu_seqlens=torch.tensor([0, len(seq)]),
            max_seqlen=len(seq),
        )
        torch.testing.assert_close(packed[cu[i] : cu[i + 1]], alone, rtol=1e-5, atol=1e-6)


def test_attention_never_crosses_sequence_boundaries():
    torch.manual_seed(0)
    q, k, v = (torch.randn(6, 2, 4) for _ in range(3))
    cu = torch.tensor([0, 3, 6])
    base = varlen_causal_attention(q, k, v, cu_seqlens=cu, max_seqlen=3, impl="sdpa_masked")
    v2 = v.clone()
    v2[:3] += 100.0  # perturb only the first sequence
    out = varlen_causal_attention(q, k, v2, cu_seqlens=cu, max_seqlen=3, impl="sdpa_masked")
    torch.testing.assert_close(out[3:], base[3:])
    assert not torch.allclose(out[:3], base[:3])


@pytest.mark.parametrize("sp", [3, 8])
def test_sp_that_does_not_divide_heads_is_rejected_at_construction(sp):
    with pytest.raises(ModelConfigError, match="num_heads"):
        LlamaForCausalLM(TINY, sp_size=sp)


def test_sp_that_cannot_split_or_repeat_kv_heads_is_rejected():
    cfg = ModelConfig(**{**TINY.to_dict(), "hidden_size": 48, "num_heads": 12, "num_kv_heads": 4})
    with pytest.raises(ModelConfigError, match="num_kv_heads"):
        LlamaForCausalLM(cfg, sp_size=6)
    LlamaForCausalLM(cfg, sp_size=2)  # kv heads split
    LlamaForCausalLM(TINY, sp_size=4)  # 2 kv heads repeated to 4


def test_presets_build_and_100m_is_about_100m_parameters():
    assert ModelConfig.preset("tiny").num_layers == 2
    with torch.device("meta"):
        model = build_model(ModelConfig.preset("100m"))
    total = sum(p.numel() for p in model.parameters())
    assert 90e6 < total < 110e6, total
    with pytest.raises(ModelConfigError, match="tiny"):
        ModelConfig.preset("huge")


def test_inconsistent_dimensions_are_rejected():
    with pytest.raises(ModelConfigError, match="num_kv_heads"):
        ModelConfig(**{**TINY.to_dict(), "num_kv_heads": 3})
