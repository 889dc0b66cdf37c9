"""HFCausalLM: packed forward == HF's own per-sequence forward, exact names, and the known traps."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from _tiny_variants import TINY_VARIANTS

from verl_balance.models import ModelConfig, ModelConfigError, build_model, load_model_config
from verl_balance.models import attention as attention_module
from verl_balance.models.attention import HF_ATTN_IMPLEMENTATION, hf_packed_attention_forward
from verl_balance.models.hf import SUPPORTED_MODEL_TYPES, HFCausalLM, HFModelConfig, build_hf_model
from verl_balance.models.output_head import LogitTransform

LENGTHS = [5, 1, 12, 3, 9]  # longer than every test sliding window
RTOL, ATOL = 1e-5, 1e-5


def _packed_inputs(vocab_size: int, *, seed: int = 0, lengths=LENGTHS):
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    positions = torch.cat([torch.arange(n) for n in lengths])
    return seqs, dict(input_ids=torch.cat(seqs), position_ids=positions, cu_seqlens=cu, max_seqlen=max(lengths))


def _max_error_vs_per_sequence(adapter: HFCausalLM, reference, *, train: bool = True, lengths=LENGTHS) -> float:
    """Largest |packed - reference| relative excess over the tolerance (<= 0 means within)."""
    seqs, inputs = _packed_inputs(adapter.config.vocab_size, lengths=lengths)
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
@pytest.mark.parametrize("variant", ["mistral", "gemma2"])  # one window on all layers; on layer 0 only
def test_sliding_window_is_honoured_not_ignored(tiny_model_dirs, monkeypatch, impl, variant):
    """The window configs only pass because the window is applied: dropping it fails."""
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs[variant])
    assert cfg.sliding_window < max(LENGTHS)
    adapter, reference = HFCausalLM(cfg, attn_impl=impl), build_hf_model(cfg, attn_implementation="sdpa")
    real = attention_module.varlen_causal_attention
    monkeypatch.setattr(
        attention_module,
        "varlen_causal_attention",
        lambda *a, sliding_window=None, **kw: real(*a, sliding_window=None, **kw),
    )
    assert _max_error_vs_per_sequence(adapter, reference) > 0


@pytest.mark.parametrize("impl", ["sdpa_masked", "sdpa_loop"])
def test_per_layer_window_is_not_applied_to_global_layers(tiny_model_dirs, monkeypatch, impl):
    """Gemma: layer 0 is windowed, layer 1 global; windowing every layer must fail the comparison."""
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["gemma3_text"])
    adapter, reference = HFCausalLM(cfg, attn_impl=impl), build_hf_model(cfg, attn_implementation="sdpa")
    real = attention_module.varlen_causal_attention
    monkeypatch.setattr(
        attention_module,
        "varlen_causal_attention",
        lambda *a, sliding_window=None, **kw: real(*a, sliding_window=cfg.sliding_window, **kw),
    )
    assert _max_error_vs_per_sequence(adapter, reference) > 0


@pytest.mark.parametrize("impl", ["sdpa_masked", "sdpa_loop"])
def test_attention_soft_cap_is_honoured_not_ignored(tiny_model_dirs, monkeypatch, impl):
    """Gemma 2's attn_logit_softcapping: dropping the cap in packed attention fails the comparison."""
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["gemma2"])
    adapter, reference = HFCausalLM(cfg, attn_impl=impl), build_hf_model(cfg, attn_implementation="sdpa")
    real = attention_module.varlen_causal_attention
    monkeypatch.setattr(
        attention_module, "varlen_causal_attention", lambda *a, softcap=None, **kw: real(*a, softcap=None, **kw)
    )
    assert _max_error_vs_per_sequence(adapter, reference) > 0


def test_hf_sdpa_drops_the_soft_cap_so_the_reference_is_eager(tiny_model_dirs):
    """The trap: HF's "sdpa" ignores ``softcap``; build_hf_model gives such a model "eager". Newer
    transformers (5.2x) close the trap themselves by refusing sdpa for Gemma 2: either way, no run
    gets HF's sdpa logits for a soft-capped model."""
    from transformers import AutoModelForCausalLM

    cfg = HFModelConfig.from_pretrained(tiny_model_dirs["gemma2"])
    exact = build_hf_model(cfg, attn_implementation="sdpa")
    assert exact.config._attn_implementation == "eager"
    try:
        raw_sdpa = AutoModelForCausalLM.from_pretrained(cfg.path, attn_implementation="sdpa", dtype=torch.float32)
    except ValueError as err:
        assert "scaled_dot_product_attention" in str(err), err  # the refusal, not another failure
        return
    ids = _packed_inputs(cfg.vocab_size)[0][2][None]
    with torch.no_grad():
        assert not torch.allclose(raw_sdpa(input_ids=ids).logits, exact(input_ids=ids).logits, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("variant", ["gemma2", "granite"])
def test_family_logit_transform_is_applied(tiny_model_dirs, variant):
    """Gemma 2's final soft-cap and Granite's logits_scaling: without them the logits are not HF's."""
    cfg = HFModelConfig.from_pretrained(tiny_model_dirs[variant])
    adapter, reference = HFCausalLM(cfg), build_hf_model(cfg, attn_implementation="sdpa")
    assert adapter.logit_transform == LogitTransform.from_hf_config(reference.config)
    assert not adapter.logit_transform.is_identity
    adapter.logit_transform = LogitTransform()
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


@pytest.mark.parametrize("variant", [v for v in TINY_VARIANTS if v not in ("llama_kv1_tied", "qwen2_untied_window")])
def test_fsdp_units_are_exactly_the_decoder_layers(tiny_model_dirs, variant):
    """HF's _no_split_modules per family (Gemma 3 also names vision modules, absent from the text model)."""
    model = HFCausalLM(HFModelConfig.from_pretrained(tiny_model_dirs[variant]))
    units = model.fsdp_units()
    assert len(units) == model.config.num_layers
    assert all(u is layer for u, layer in zip(units, model.model.layers))
    assert all(type(u).__name__.endswith("DecoderLayer") for u in units)


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


def test_every_supported_model_type_has_a_tiny_variant():
    assert {kw["family"] for kw in TINY_VARIANTS.values()} == set(SUPPORTED_MODEL_TYPES)


def test_multimodal_gemma3_is_refused_pointing_at_the_text_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ModelConfigError, match=r"gemma3'.*Gemma3ForCausalLM, model_type gemma3_text.*supported"):
        HFModelConfig.from_pretrained(str(tmp_path))


@pytest.mark.parametrize(
    ("variant", "key", "value"),
    [
        ("gemma3_text", "use_bidirectional_attention", True),
        ("mixtral", "router_jitter_noise", 0.1),
        ("qwen2_moe", "use_sliding_window", True),
        ("olmo2", "attention_dropout", 0.1),
    ],
)
def test_unsupported_family_feature_fails_at_start_up_naming_type_and_key(
    tiny_model_dirs, tmp_path, variant, key, value
):
    config = json.loads(open(os.path.join(tiny_model_dirs[variant], "config.json")).read())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(ModelConfigError, match=rf"model_type={config['model_type']}\) sets {key}="):
        HFModelConfig.from_pretrained(str(tmp_path))


def test_unknown_or_non_causal_attention_arguments_are_refused_at_call():
    q = torch.zeros(1, 2, 3, 4)
    cu = torch.tensor([0, 3])
    module = torch.nn.Linear(1, 1)
    with pytest.raises(ModelConfigError, match=r"Linear passes attention argument\(s\) \['s_aux'\]"):
        hf_packed_attention_forward(module, q, q, q, None, cu_seq_lens_q=cu, max_length_q=3, s_aux=torch.zeros(2))
    module.is_causal = False
    with pytest.raises(ModelConfigError, match="not causal"):
        hf_packed_attention_forward(module, q, q, q, None, cu_seq_lens_q=cu, max_length_q=3)
    module.is_causal = True  # passthrough keywords and None-valued features are accepted
    out, _ = hf_packed_attention_forward(
        module, q, q, q, None, cu_seq_lens_q=cu, max_length_q=3, position_ids=None, softcap=None, use_cache=False
    )
    assert out.shape == (1, 3, 2, 4)


def test_length_dependent_rope_is_exact_up_to_its_original_length_and_refused_beyond(tiny_model_dirs, tmp_path):
    """Phi-3 longrope: HF picks short/long factors by max(position_ids) of the call, i.e. the
    longest packed sequence; exact while every sequence fits the original length, refused after."""
    import shutil

    shutil.copytree(tiny_model_dirs["phi3"], tmp_path / "phi3")
    config_file = tmp_path / "phi3" / "config.json"
    config = json.loads(config_file.read_text())
    half = config["hidden_size"] // config["num_attention_heads"] // 2
    config["rope_parameters"] = dict(
        rope_type="longrope",
        rope_theta=10000.0,
        partial_rotary_factor=1.0,
        short_factor=[1.0] * half,
        long_factor=[4.0] * half,
        original_max_position_embeddings=8,
    )
    config["original_max_position_embeddings"] = 8
    config_file.write_text(json.dumps(config))
    cfg = HFModelConfig.from_pretrained(str(tmp_path / "phi3"))
    adapter, reference = HFCausalLM(cfg), build_hf_model(cfg, attn_implementation="sdpa")
    assert adapter.rope_length_limit == 8
    assert _max_error_vs_per_sequence(adapter, reference, lengths=[5, 1, 8, 3]) <= 0
    with pytest.raises(ModelConfigError, match=r"12 tokens exceeds original_max_position_embeddings=8"):
        _max_error_vs_per_sequence(adapter, reference)


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


@pytest.mark.parametrize("variant", ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "llama"])
def test_flops_workload_of_the_adapter_config_counts_the_same_experts_as_hf_config(tiny_model_dirs, variant):
    from verl_balance.balance import FlopsWorkload

    cfg = HFModelConfig.from_pretrained(tiny_model_dirs[variant])
    ours, theirs = FlopsWorkload.from_model_config(cfg), FlopsWorkload.from_model_config(cfg.hf_config())
    lengths = np.array([1, 7, 300])
    np.testing.assert_array_equal(ours.cost(lengths), theirs.cost(lengths))
    assert (ours.num_experts, ours.num_experts_per_tok) == ((4, 2) if cfg.num_experts else (0, 0))
