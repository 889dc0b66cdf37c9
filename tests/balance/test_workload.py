"""Workload models against hand-counted FLOPs."""

from dataclasses import dataclass

import numpy as np
import pytest

from verl_balance.balance import BalanceConfigError, FlopsWorkload, TokenWorkload, from_model_config


def test_token_workload_is_the_length():
    lengths = np.array([0, 1, 7, 4096])
    np.testing.assert_array_equal(TokenWorkload().cost(lengths), lengths.astype(np.float64))


def test_flops_match_a_hand_count():
    # 1 layer, hidden 4, ffn 8, 2 heads of dim 2, 1 kv head, vocab 10.
    w = FlopsWorkload(num_layers=1, hidden_size=4, intermediate_size=8, num_heads=2, num_kv_heads=1, vocab_size=10)
    q, k, v, o = 4 * 4, 4 * 2, 4 * 2, 4 * 4  # weight sizes: q [4,4], k/v [2,4], o [4,4]
    mlp = 3 * 4 * 8
    lm_head = 4 * 10
    linear_per_token = 2 * (q + k + v + o + mlp + lm_head)
    length = 5
    pairs = length * (length + 1) // 2  # causal triangle incl. the diagonal
    attention = pairs * 2 * 2 * (2 * 2)  # QK^T and AV, 2 FLOPs per MAC, heads * head_dim = 4
    assert w.cost(np.array([length]))[0] == linear_per_token * length + attention


def test_flops_are_quadratic_so_one_long_sequence_outweighs_many_short():
    w = FlopsWorkload(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=100)
    long, short = w.cost(np.array([4096, 64]))
    assert long > 64 * short  # same token count, attention makes the long one heavier
    assert TokenWorkload().cost(np.array([4096]))[0] == 64 * TokenWorkload().cost(np.array([64]))[0]


def test_from_model_config_reads_attributes_duck_typed():
    @dataclass
    class Cfg:
        vocab_size: int = 100
        hidden_size: int = 32
        intermediate_size: int = 64
        num_layers: int = 2
        num_heads: int = 4
        num_kv_heads: int = 2

    w = from_model_config(Cfg())
    assert (w.num_layers, w.hidden_size, w.num_kv_heads, w.vocab_size) == (2, 32, 2, 100)
    with pytest.raises(BalanceConfigError, match="num_kv_heads"):
        from_model_config(type("Partial", (), {"hidden_size": 4})())


def test_flops_rejects_heads_not_divisible_by_kv_heads():
    with pytest.raises(BalanceConfigError, match="num_kv_heads"):
        FlopsWorkload(num_layers=1, hidden_size=8, intermediate_size=8, num_heads=3, num_kv_heads=2, vocab_size=8)


def test_hf_config_with_explicit_head_dim_and_gqa_matches_a_hand_count():
    """A transformers config (HF names): qwen3-style head_dim 8 != hidden 16 / 4 heads, 1 kv head."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=10,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=8,
    )
    w = from_model_config(cfg)
    q, o = 16 * (4 * 8), (4 * 8) * 16
    k = v = 16 * (1 * 8)
    mlp = 3 * 16 * 24
    linear_per_token = 2 * (2 * (q + k + v + o + mlp) + 16 * 10)
    attention_per_pair = 2 * 2 * (4 * 8) * 2  # QK^T and AV, heads * head_dim, 2 layers
    length = 7
    expected = linear_per_token * length + attention_per_pair * length * (length + 1) / 2
    assert w.cost(np.array([length]))[0] == expected

    # The same dimensions under our names (e.g. models.hf.HFModelConfig) give the same workload.
    @dataclass
    class Ours:
        vocab_size: int = 10
        hidden_size: int = 16
        intermediate_size: int = 24
        num_layers: int = 2
        num_heads: int = 4
        num_kv_heads: int = 1
        head_dim: int = 8

    assert from_model_config(Ours()) == w
    # Negative control: ignoring the explicit head_dim undercounts.
    assert from_model_config(Ours(head_dim=None)).cost(np.array([length]))[0] < expected


def test_hf_config_without_kv_heads_is_multi_head_attention():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=10, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=4
    )
    assert from_model_config(cfg).num_kv_heads == 4


def _attention_and_head(h: int, heads: int, kv_heads: int, d: int, vocab: int, layers: int) -> int:
    """Multiply-adds per token of q/k/v/o in every layer plus the LM head."""
    return layers * (2 * h * heads * d + 2 * h * kv_heads * d) + h * vocab


def test_moe_counts_active_experts_shared_experts_and_router_by_hand():
    # Qwen2-MoE-style dict: 3 layers, layer 1 dense (mlp_only_layers), 8 experts of width 6, top-2,
    # shared experts of total width 10, hidden 4, dense MLP 16, 2 heads of dim 2, vocab 10.
    cfg = {
        "num_hidden_layers": 3,
        "hidden_size": 4,
        "intermediate_size": 16,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": 10,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 6,
        "shared_expert_intermediate_size": 10,
        "mlp_only_layers": [1],
        "decoder_sparse_step": 1,
    }
    w = FlopsWorkload.from_model_config(cfg)
    assert (w.num_experts, w.num_experts_per_tok, w.num_moe_layers) == (8, 2, 2)
    dense_mlp = 3 * 4 * 16  # gate, up, down of the dense layer
    moe_mlp = 4 * 8 + 2 * (3 * 4 * 6) + 3 * 4 * 10  # router + 2 active experts + shared experts = 216
    macs = _attention_and_head(4, 2, 2, 2, 10, 3) + dense_mlp + 2 * moe_mlp
    assert w.linear_flops_per_token == 2 * macs
    # All 8 experts would be 8 * 72 = 576 expert MACs per layer: active counting is far below it.
    total_params = FlopsWorkload.from_model_config({**cfg, "num_experts_per_tok": 8}).linear_flops_per_token
    assert total_params > w.linear_flops_per_token
    # Attention is unchanged by MoE: the quadratic term is the dense model's.
    dense = FlopsWorkload.from_model_config({k: v for k, v in cfg.items() if "expert" not in k})
    assert w.attention_flops_per_pair == dense.attention_flops_per_pair


def test_mixtral_experts_have_the_intermediate_size_and_every_layer_routes():
    @dataclass
    class MixtralLike:
        num_hidden_layers: int = 2
        hidden_size: int = 4
        intermediate_size: int = 6
        num_attention_heads: int = 2
        num_key_value_heads: int = 1
        vocab_size: int = 10
        num_local_experts: int = 4
        num_experts_per_tok: int = 2

    w = FlopsWorkload.from_model_config(MixtralLike())
    per_layer_mlp = 4 * 4 + 2 * 3 * 4 * 6  # router + 2 experts of width 6
    assert w.linear_flops_per_token == 2 * (_attention_and_head(4, 2, 1, 2, 10, 2) + 2 * per_layer_mlp)


def test_deepseek_dense_prefix_and_shared_experts():
    cfg = dict(
        num_hidden_layers=4,
        hidden_size=4,
        intermediate_size=16,
        num_attention_heads=2,
        vocab_size=10,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=3,
        n_shared_experts=2,
        first_k_dense_replace=1,
        moe_layer_freq=1,
    )
    w = FlopsWorkload.from_model_config(cfg)
    assert (w.num_moe_layers, w.shared_expert_intermediate_size) == (3, 6)


def test_moe_top_k_beyond_the_experts_is_rejected():
    with pytest.raises(BalanceConfigError, match="num_experts_per_tok"):
        FlopsWorkload(
            num_layers=1,
            hidden_size=4,
            intermediate_size=8,
            num_heads=2,
            num_kv_heads=2,
            vocab_size=10,
            num_experts=2,
            num_experts_per_tok=3,
        )
