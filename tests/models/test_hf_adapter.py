"""HFCausalLM: packed forward == HF's own per-sequence forward, exact names, and the known traps."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _tiny_variants import TINY_VARIANTS

from verl_balance.models import ModelConfig, ModelConfigError, build_model, load_model_config
from verl_balance.models import attention as attention_module
from verl_balance.models.attention import HF_ATTN_IMPLEMENTATION
from verl_balance.models.hf import HFCausalLM, HFModelConfig, build_hf_model

LENGTHS = [5, 1, 12, 3, 9]  # longer than every test sliding window
RTOL, ATOL = 1e-5, 1e-5


def _packed_inputs(vocab_size: int, *, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in LENGTHS]
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return seqs, dict(input_ids=torch.cat(seqs), position_ids=positions, cu_seqlens=cu, max_seqlen=max(LENGTHS))


def _max_error_vs_per_sequence(adapter: HFCausalLM, reference, *, train: bool = True) -> float:
    """Largest |packed - reference| relative excess over the tolerance (<= 0 means within)."""
    seqs, inputs = _packed_inputs(adapter.config.vocab_size)
    adapter.train(train)
    reference.eval()
    packed = adapter(**inputs)
    worst = -float("inf")
    cu = inputs["cu_seqlens"]
    with torch.no_grad():
        for i, seq in enumerate(seqs):
            alone = reference(input_ids=seq[None], use_cache=False).logits[0]
            got = packed[cu[i] : cu[i + 1]].detach()
            excess = (got - alone).abs() - (ATOL + RTOL * alone.abs())
            worst = max(worst, float(excess.max()))
    return worst


@pytest.mark.parametrize("impl", ["sdpa_masked", "sdpa_loop"])
@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_packed_forward_equals_hf_per_sequence_forward(tiny_model_dirs, variant, impl):
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs[variant])
    adapter, reference = HFCausalLM(cfg, attn_impl=impl), build_hf_model(cfg, attn_implementation="sdpa")
    assert _max_error_vs_per_sequence(adapter, reference) <= 0


@pytest.mark.parametrize("impl", ["sdpa_masked", "sdpa_loop"])
def test_leaking_attention_is_detected(tiny_model_dirs, monkeypatch, impl):
    """Negative control: attention that ignores sequence boundaries must fail the comparison."""
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["llama"])
    adapter, reference = HFCausalLM(cfg, attn_impl=impl), build_hf_model(cfg, attn_implementation="sdpa")
    real = attention_module.varlen_causal_attention

    def leaking(q, k, v, *, cu_seqlens, **kw):
        return real(q, k, v, cu_seqlens=torch.tensor([0, q.shape[0]]), **kw)

    monkeypatch.setattr(attention_module, "varlen_causal_attention", leaking)
    assert _max_error_vs_per_sequence(adapter, reference) > 0


@pytest.mark.parametrize("impl", ["sdpa_masked", "sdpa_loop"])
def test_sliding_window_is_honoured_not_ignored(tiny_model_dirs, monkeypatch, impl):
    """The mistral/qwen2 window configs only pass because the window is applied: dropping it fails."""
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["mistral"])
    assert cfg.sliding_window == 6 < max(LENGTHS)
    adapter, reference = HFCausalLM(cfg, attn_impl=impl), build_hf_model(cfg, attn_implementation="sdpa")
    real = attention_module.varlen_causal_attention
    monkeypatch.setattr(
        attention_module,
        "varlen_causal_attention",
        lambda *a, sliding_window=None, **kw: real(*a, sliding_window=None, **kw),
    )
    assert _max_error_vs_per_sequence(adapter, reference) > 0


def test_parameter_names_are_exactly_hf_names_and_load_both_ways(tiny_model_dirs):
    for variant in ("llama", "qwen2"):
        cfg = HFModelConfig.from_pretrained(tiny_model_dirs[variant])
        adapter, reference = HFCausalLM(cfg), build_hf_model(cfg)
        assert list(adapter.state_dict()) == list(reference.state_dict())
        assert dict(adapter.named_parameters()).keys() == dict(reference.named_parameters()).keys()
        reference.load_state_dict(adapter.state_dict(), strict=True)


def test_tied_embeddings_stay_one_parameter(tiny_model_dirs):
    tied = HFCausalLM(HFModelConfig.from_pretrained(tiny_model_dirs["llama_kv1_tied"]))
    assert tied.config.tie_word_embeddings
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = HFCausalLM(HFModelConfig.from_pretrained(tiny_model_dirs["llama"]))
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_use_cache_default_does_not_disable_packed_masking(tiny_model_dirs):
    """HF configs default to use_cache=True; with HF's own SDPA that silently leaks across packed
    sequences in train mode (shown first), the adapter is exact regardless."""
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["llama"])
    reference = build_hf_model(cfg, attn_implementation="sdpa")
    assert reference.config.use_cache is True
    seqs, inputs = _packed_inputs(cfg.vocab_size)
    reference.train()
    with torch.no_grad():
        hf_packed = reference(input_ids=inputs["input_ids"][None], position_ids=inputs["position_ids"][None]).logits[0]
        alone = reference(input_ids=seqs[1][None], use_cache=False).logits[0]
    cu = inputs["cu_seqlens"]
    assert not torch.allclose(hf_packed[cu[1] : cu[2]], alone, rtol=RTOL, atol=ATOL)  # the trap
    adapter = HFCausalLM(cfg)
    assert adapter.hf_model.config.use_cache is True
    assert _max_error_vs_per_sequence(adapter, reference, train=True) <= 0


def test_all_ones_2d_mask_trap_does_not_reach_the_adapter(tiny_model_dirs):
    """A 2-D all-ones mask also turns off HF's packed detection (shown); the adapter takes no mask."""
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["qwen2"])
    reference = build_hf_model(cfg, attn_implementation="sdpa")
    seqs, inputs = _packed_inputs(cfg.vocab_size)
    ids, pos = inputs["input_ids"][None], inputs["position_ids"][None]
    with torch.no_grad():
        detected = reference(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        masked = reference(
            input_ids=ids, position_ids=pos, use_cache=False, attention_mask=torch.ones_like(ids)
        ).logits[0]
    assert not torch.allclose(detected, masked, rtol=RTOL, atol=ATOL)  # the trap
    with pytest.raises(TypeError):
        HFCausalLM(cfg)(**inputs, attention_mask=torch.ones_like(ids))


def test_scaling_comes_from_the_model_not_from_hidden_over_heads(tiny_model_dirs, monkeypatch):
    """qwen3 has head_dim != hidden/heads; attention must use the scaling HF passes in."""
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["qwen3"])
    assert cfg.head_dim != cfg.hidden_size // cfg.num_heads
    adapter, reference = HFCausalLM(cfg), build_hf_model(cfg, attn_implementation="sdpa")
    assert _max_error_vs_per_sequence(adapter, reference) <= 0
    real = attention_module.packed_attention
    wrong = (cfg.hidden_size // cfg.num_heads) ** -0.5
    monkeypatch.setattr(
        attention_module, "packed_attention", lambda *a, scaling=None, **kw: real(*a, scaling=wrong, **kw)
    )
    assert _max_error_vs_per_sequence(adapter, reference) > 0


def test_from_config_twice_does_not_switch_the_adapters_attention(tiny_model_dirs):
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["llama"])
    adapter = HFCausalLM(cfg)
    build_hf_model(cfg, attn_implementation="sdpa")
    build_hf_model(cfg, attn_implementation="eager")
    assert adapter.hf_model.config._attn_implementation == HF_ATTN_IMPLEMENTATION
    # The trap itself: one shared config object is rewritten by the second from_config.
    from transformers import AutoModelForCausalLM

    shared = cfg.hf_config()
    first = AutoModelForCausalLM.from_config(shared, attn_implementation=HF_ATTN_IMPLEMENTATION)
    AutoModelForCausalLM.from_config(shared, attn_implementation="sdpa")
    assert first.config._attn_implementation == "sdpa"


def test_gradient_checkpointing_gives_identical_loss_and_gradients(tiny_model_dirs):
    path = tiny_model_dirs["qwen2"]
    grads = []
    for checkpointing in (False, True):
        model = HFCausalLM(HFModelConfig.from_pretrained(path, enable_gradient_checkpointing=checkpointing))
        model.train()
        _, inputs = _packed_inputs(model.config.vocab_size)
        loss = model(**inputs).float().logsumexp(-1).mean()
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_fsdp_units_are_the_no_split_modules(tiny_model_dirs):
    model = HFCausalLM(HFModelConfig.from_pretrained(tiny_model_dirs["mistral"]))
    units = model.fsdp_units()
    assert [type(u).__name__ for u in units] == ["MistralDecoderLayer"] * model.config.num_layers
    assert all(u is layer for u, layer in zip(units, model.model.layers))


def test_random_init_draws_from_torch_rng(tiny_model_dirs):
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["llama"], init="random")
    torch.manual_seed(3)
    a = build_model(cfg).state_dict()
    torch.manual_seed(3)
    b = build_model(cfg).state_dict()
    pretrained = build_model(HFModelConfig.from_pretrained(tiny_model_dirs["llama"])).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], pretrained["model.layers.0.mlp.up_proj.weight"])


def test_unsupported_model_type_is_rejected_naming_it_and_the_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelConfigError, match=r"gpt2.*llama.*qwen2.*qwen3.*mistral"):
        HFModelConfig.from_pretrained(str(tmp_path))
    with pytest.raises(ModelConfigError, match="config.json"):
        HFModelConfig.from_pretrained(str(tmp_path / "missing"))


def test_load_model_config_picks_preset_or_hf_and_checks_keys(tiny_model_dirs):
    preset = load_model_config(name="tiny", path=None, overrides={"num_layers": 3, "hidden_size": None}, vocab_size=100)
    assert isinstance(preset, ModelConfig) and preset.num_layers == 3 and preset.vocab_size == 100
    hf = load_model_config(name="tiny", path=tiny_model_dirs["qwen3"], overrides={"init": "random"}, vocab_size=100)
    assert isinstance(hf, HFModelConfig) and hf.model_type == "qwen3" and hf.init == "random"
    for key in (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "max_position_embeddings",
    ):
        assert isinstance(getattr(hf, key), int) and isinstance(getattr(preset, key), int)
    assert set(hf.to_dict()) >= {"vocab_size", "num_layers", "head_dim"}
    with pytest.raises(ModelConfigError, match="num_layers"):
        load_model_config(name=None, path=tiny_model_dirs["qwen3"], overrides={"num_layers": 7}, vocab_size=10)
    with pytest.raises(ModelConfigError, match="tokenizer"):
        load_model_config(name=None, path=tiny_model_dirs["qwen3"], overrides={}, vocab_size=10**6)
    checkpointed = load_model_config(
        name="tiny", path=None, overrides={"enable_gradient_checkpointing": True}, vocab_size=10
    )
    assert isinstance(checkpointed, ModelConfig) and checkpointed.enable_gradient_checkpointing
    with pytest.raises(ModelConfigError, match="init"):
        load_model_config(name="tiny", path=None, overrides={"init": "random"}, vocab_size=10)
    with pytest.raises(ModelConfigError, match="init"):
        load_model_config(name=None, path=tiny_model_dirs["llama"], overrides={"init": "zeros"}, vocab_size=10)


def test_sp_that_neither_divides_nor_is_divided_by_kv_heads_names_both(tiny_model_dirs):
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["llama"])  # 4 heads, 2 kv heads
    with pytest.raises(ModelConfigError, match=r"ulysses_sequence_parallel_size=3.*num_heads=4"):
        HFCausalLM(cfg, sp_size=3)
    with pytest.raises(ModelConfigError, match=r"ulysses_sequence_parallel_size=8.*num_heads=4"):
        HFCausalLM(cfg, sp_size=8)
    assert os.path.isdir(cfg.path)
