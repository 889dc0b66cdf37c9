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
