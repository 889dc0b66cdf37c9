"""HFRollout: KV-cached decoding of HF models == uncached recompute == the training adapter's logits."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from verl_balance.models.hf import HFCausalLM, HFModelConfig  # noqa: E402
from verl_balance.models.tiny_hf import write_tiny_model  # noqa: E402
from verl_balance.rollout import build_rollout  # noqa: E402
from verl_balance.rollout.hf_generator import HFRollout  # noqa: E402

VARIANTS = {
    "llama_kv1_tied": {"family": "llama", "num_kv_heads": 1, "tie_word_embeddings": True},
    "qwen2": {"family": "qwen2"},
    "qwen3": {"family": "qwen3"},
    "mistral_window4": {"family": "mistral", "sliding_window": 4},
    # per-layer window, attention and final soft-caps (HF's "sdpa" would drop the attention cap)
    "gemma2": {"family": "gemma2"},
    "mixtral": {"family": "mixtral"},  # MoE routing under a KV cache
}
PROMPTS = [[5, 17, 3, 9, 1], [2], [40, 41, 42], [7, 7, 7, 7, 7, 7, 7], [99, 3]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hf_rollout")
    return {name: write_tiny_model(str(root / name), **kw) for name, kw in VARIANTS.items()}


def _adapter_logits(config: HFModelConfig, state_dict, sequences):
    """The training adapter's packed, uncached logits for each sequence."""
    model = HFCausalLM(config)
    model.load_state_dict(state_dict)
    lengths = [len(s) for s in sequences]
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([t for s in sequences for t in s]),
            position_ids=torch.cat([torch.arange(n) for n in lengths]),
            cu_seqlens=torch.tensor([0] + lengths).cumsum(0),
            max_seqlen=max(lengths),
        )
    return list(logits.split(lengths))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_greedy_generation_equals_uncached_recompute(model_dirs, variant):
    config = HFModelConfig.from_pretrained(model_dirs[variant])
    rollout = build_rollout(config, pad_token_id=0)
    assert isinstance(rollout, HFRollout)
    out = rollout.generate(PROMPTS, temperature=0.0, max_response_length=10)
    assert out.response_lengths.tolist() == [10] * len(PROMPTS)
    for prompt, response in zip(PROMPTS, out.response_token_lists()):
        with torch.no_grad():  # one unpadded sequence, no cache
            logits = rollout.model(input_ids=torch.tensor([prompt + response]), use_cache=False).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == response


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_logits_equal_training_adapter_logits(model_dirs, variant):
    config = HFModelConfig.from_pretrained(model_dirs[variant])
    torch.manual_seed(1)
    trained = HFCausalLM(HFModelConfig.from_pretrained(model_dirs[variant], init="random")).state_dict()
    rollout = build_rollout(config, state_dict=trained)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (9, 4, 13, 1, 6)]
    expected = _adapter_logits(config, trained, sequences)
    for prefill_lengths in (None, [3, 4, 1, 1, 5]):
        got = rollout.forward_logits(sequences, prefill_lengths=prefill_lengths)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    # Negative control: the directory's own (different) weights must fail the same comparison.
    untouched = build_rollout(config)
    assert not torch.allclose(untouched.forward_logits(sequences)[0], expected[0], rtol=1e-4, atol=1e-4)


def test_batching_and_stop_tokens_match_one_at_a_time(model_dirs):
    config = HFModelConfig.from_pretrained(model_dirs["qwen2"])
    together = HFRollout(model_config=config).generate(PROMPTS, temperature=0.0, max_response_length=8)
    stop = together.response_token_lists()[0][2]
    together = HFRollout(model_config=config).generate(
        PROMPTS, temperature=0.0, max_response_length=8, stop_token_ids=[stop]
    )
    alone = HFRollout(model_config=config, max_batch_size=1).generate(
        PROMPTS, temperature=0.0, max_response_length=8, stop_token_ids=[stop]
    )
    assert torch.equal(together.responses, alone.responses)
    torch.testing.assert_close(together.log_probs, alone.log_probs, rtol=1e-5, atol=1e-5)
    assert together.finish_reasons[0] == "stop" and together.response_lengths[0] == 3


def test_tied_state_dict_without_lm_head_loads(model_dirs):
    config = HFModelConfig.from_pretrained(model_dirs["llama_kv1_tied"])
    state = HFCausalLM(config).state_dict()
    state.pop("lm_head.weight")
    HFRollout(model_config=config, state_dict=state)
    with pytest.raises(ValueError, match="missing"):
        HFRollout(model_config=config, state_dict={k: v for k, v in state.items() if "layers.0" not in k})


def test_weights_are_referenced_and_tied_embeddings_stay_tied(model_dirs):
    config = HFModelConfig.from_pretrained(model_dirs["llama_kv1_tied"])
    state = {k: v.clone() for k, v in HFCausalLM(config).state_dict().items()}  # gathered: two copies
    rollout = HFRollout(model_config=config, state_dict=state)
    embed = rollout.model.model.embed_tokens.weight
    assert embed.data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    assert rollout.model.lm_head.weight is embed
    half = HFRollout(model_config=config, state_dict=state, dtype=torch.bfloat16)
    assert half.model.lm_head.weight.dtype == torch.bfloat16 and state["lm_head.weight"].dtype == torch.float32
    assert half.generate([[3, 4]], temperature=0.0, max_response_length=3).responses.shape == (1, 3)


@pytest.mark.parametrize("variant", ["llama_kv1_tied", "mistral_window4"])
def test_cpu_rollout_grouped_sdpa_equals_hf_sdpa_on_left_padded_batches(model_dirs, variant):
    """On CPU the rollout hands grouped KV heads to SDPA unrepeated; its logits equal HF's own sdpa
    (which repeats the heads under a padding mask) on a left-padded batch, prefill and decode."""
    from verl_balance.models.attention import GROUPED_SDPA_ATTN_IMPLEMENTATION

    config = HFModelConfig.from_pretrained(model_dirs[variant])
    rollout = build_rollout(config, pad_token_id=0)
    assert rollout.model.config._attn_implementation == GROUPED_SDPA_ATTN_IMPLEMENTATION
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (9, 4, 13, 1, 6)]
    grouped = rollout.forward_logits(sequences, prefill_lengths=[3, 4, 1, 1, 5])
    rollout.model.set_attn_implementation("sdpa")
    assert rollout.model.config._attn_implementation == "sdpa"  # the reference is HF's own path
    repeated = rollout.forward_logits(sequences, prefill_lengths=[3, 4, 1, 1, 5])
    for g, r in zip(grouped, repeated):
        # fp32 logits of O(1): kernels that sum in another order differ by ~4e-6 (transformers 5.25);
        # a wrong mask or head grouping moves them by O(0.1)
        torch.testing.assert_close(g, r, rtol=1e-5, atol=2e-5)


def test_soft_capped_rollout_keeps_eager_attention(model_dirs):
    config = HFModelConfig.from_pretrained(model_dirs["gemma2"])
    assert build_rollout(config, pad_token_id=0).model.config._attn_implementation == "eager"
