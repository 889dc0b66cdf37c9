"""KVCacheRollout: the KV-cached, left-padded decoder against no-cache recomputes and the training model."""

import dataclasses

import pytest
import torch

from verl_balance.models import LlamaForCausalLM, ModelConfig
from verl_balance.rollout import KVCacheRollout, RolloutInputError, StateDictError, build_rollout_tensors
from verl_balance.rollout.kv_cache_generator import expected_state_dict_shapes

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROMPTS = [[5, 17, 3, 9, 1], [2], [40, 41, 42], [7, 7, 7, 7, 7, 7, 7], [99, 3]]


def _config(*, tie: bool = False) -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset("tiny"), max_position_embeddings=64, tie_word_embeddings=tie)


def _random_state_dict(config: ModelConfig, *, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Weights far from the tiny default init, so logits are peaked and greedy has no near-ties."""
    gen = torch.Generator().manual_seed(seed)
    shapes = expected_state_dict_shapes(config)
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            state[name] = 1 + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = torch.randn(shape, generator=gen) / shape[-1] ** 0.5 * 1.5
    return {k: v.to(device) for k, v in state.items()}


def _rollout(*, tie=False, seed=0, device="cpu", **kwargs) -> KVCacheRollout:
    config = _config(tie=tie)
    state_dict = _random_state_dict(config, seed=seed, device=device)
    return KVCacheRollout(model_config=config, state_dict=state_dict, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tie", [False, True])
def test_cached_greedy_generation_equals_uncached_recompute(tie, device):
    rollout = _rollout(tie=tie, device=device)
    out = rollout.generate(PROMPTS, n=1, temperature=0.0, max_response_length=12)
    assert out.response_lengths.tolist() == [12] * len(PROMPTS)
    for prompt, response in zip(PROMPTS, out.response_token_lists()):
        # A single unpadded sequence, prefilled in one pass: no cache reuse, no left padding.
        logits = rollout.forward_logits([prompt + response])[0]
        recomputed = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        assert recomputed == response


def test_batching_and_left_padding_do_not_change_greedy_output():
    rollout_all, rollout_one = _rollout(), _rollout(max_batch_size=1)
    together = rollout_all.generate(PROMPTS, temperature=0.0, max_response_length=10)
    alone = rollout_one.generate(PROMPTS, temperature=0.0, max_response_length=10)
    assert torch.equal(together.responses, alone.responses)
    torch.testing.assert_close(together.log_probs, alone.log_probs)


def test_stop_token_ends_each_response_and_is_masked_in():
    rollout = _rollout()
    free = rollout.generate(PROMPTS, temperature=0.0, max_response_length=10).response_token_lists()
    stop = free[0][2]
    out = rollout.generate(PROMPTS, temperature=0.0, max_response_length=10, stop_token_ids=[stop], seed=0)
    for full, response, reason, mask in zip(free, out.response_token_lists(), out.finish_reasons, out.response_mask):
        expected = full[: full.index(stop) + 1] if stop in full else full
        assert response == expected
        assert reason == ("stop" if stop in full else "length")
        assert mask.sum().item() == len(response) and mask[: len(response)].all()
    assert out.finish_reasons[0] == "stop" and out.response_lengths[0].item() <= 3
    padded = out.responses[~out.response_mask.bool()]
    assert (padded == rollout.pad_token_id).all()


def test_sampling_is_deterministic_for_a_fixed_seed():
    rollout = _rollout()
    kwargs = dict(n=3, temperature=1.0, top_p=0.9, max_response_length=8)
    first = rollout.generate(PROMPTS, seed=123, **kwargs)
    again = rollout.generate(PROMPTS, seed=123, **kwargs)
    other = rollout.generate(PROMPTS, seed=124, **kwargs)
    assert torch.equal(first.responses, again.responses) and torch.equal(first.log_probs, again.log_probs)
    assert not torch.equal(first.responses, other.responses)
    assert first.prompt_index.tolist() == [i for i in range(len(PROMPTS)) for _ in range(3)]


def test_tiny_top_p_equals_greedy():
    rollout = _rollout()
    greedy = rollout.generate(PROMPTS, temperature=0.0, max_response_length=8)
    nucleus = rollout.generate(PROMPTS, temperature=1.0, top_p=1e-6, max_response_length=8, seed=7)
    assert torch.equal(greedy.responses, nucleus.responses)


def test_build_rollout_tensors_is_token_aligned():
    rollout = _rollout()
    out = rollout.generate(
        [[3, 4, 5], [6]],
        n=2,
        temperature=1.0,
        max_response_length=4,
        seed=0,
        stop_token_ids=[int(t) for t in range(0, 128, 3)],
    )
    tensors = build_rollout_tensors(prompts=[[3, 4, 5], [6]], output=out)
    for row, (prompt_id, response) in enumerate(zip(out.prompt_index, out.response_token_lists())):
        prompt = [[3, 4, 5], [6]][prompt_id]
        n_real = len(prompt) + len(response)
        assert tensors["input_ids"][row, :n_real].tolist() == prompt + response
        assert tensors["attention_mask"][row].tolist() == [1] * n_real + [0] * (tensors["input_ids"].shape[1] - n_real)
        assert tensors["loss_mask"][row].nonzero().flatten().tolist() == list(range(len(prompt), n_real))
        assert tensors["position_ids"][row, :n_real].tolist() == list(range(n_real))
        torch.testing.assert_close(
            tensors["rollout_log_probs"][row, len(prompt) : n_real], out.log_probs[row, : len(response)]
        )
        assert (tensors["rollout_log_probs"][row][tensors["loss_mask"][row] == 0] == 0).all()


def test_invalid_requests_raise_value_errors():
    rollout = _rollout()
    with pytest.raises(RolloutInputError, match="prompt 1 is empty"):
        rollout.generate([[1], []], max_response_length=2)
    with pytest.raises(RolloutInputError, match="prompt 0 has token ids \\[500\\]"):
        rollout.generate([[500]], max_response_length=2)
    with pytest.raises(RolloutInputError, match="max_position_embeddings=64"):
        rollout.generate([[1] * 60], max_response_length=5)
    with pytest.raises(RolloutInputError, match="top_p"):
        rollout.generate([[1]], top_p=0.0, max_response_length=2)
    bad = _random_state_dict(_config(), seed=0)
    bad["layers.1.attn.k_proj.weight"] = bad["layers.1.attn.k_proj.weight"][:8]
    with pytest.raises(StateDictError, match="layers.1.attn.k_proj.weight has shape"):
        KVCacheRollout(model_config=_config(), state_dict=bad)


# --------------------------------------------------------------------- against the training model
def _training_logits(config, state_dict, sequences):
    """Logits of the training model (packed, no cache) for each sequence, as a list of (len, V)."""
    model = LlamaForCausalLM(config).to(next(iter(state_dict.values())).device)
    model.load_state_dict(state_dict)
    device = next(model.parameters()).device
    lengths = [len(s) for s in sequences]
    input_ids = torch.tensor([t for s in sequences for t in s], device=device)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])
    cu_seqlens = torch.tensor([0] + lengths, device=device).cumsum(0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=position_ids, cu_seqlens=cu_seqlens, max_seqlen=max(lengths))
    return list(logits.split(lengths))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tie", [False, True])
def test_cached_logits_equal_training_model_logits(tie, device):
    config = _config(tie=tie)
    state_dict = _random_state_dict(config, seed=3, device=device)
    rollout = KVCacheRollout(model_config=config, state_dict=state_dict)
    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (9, 4, 13, 1, 6)]
    expected = _training_logits(config, state_dict, sequences)
    # Prefill part of each sequence (left-padded batch), then decode the rest one cached step at a time.
    for prefill_lengths in (None, [3, 4, 1, 1, 5], [1, 1, 1, 1, 1]):
        got = rollout.forward_logits(sequences, prefill_lengths=prefill_lengths)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
    # Negative control: a wrong RoPE base must be detected by the same comparison.
    wrong = KVCacheRollout(model_config=ModelConfig(**{**config.to_dict(), "rope_theta": 500.0}), state_dict=state_dict)
    assert not torch.allclose(wrong.forward_logits(sequences)[0], expected[0], rtol=1e-4, atol=1e-4)


def test_sampling_log_probs_equal_training_model_log_probs_at_temperature():
    config = _config()
    state_dict = _random_state_dict(config, seed=5)
    rollout = KVCacheRollout(model_config=config, state_dict=state_dict)
    out = rollout.generate(PROMPTS, n=2, temperature=0.7, top_p=0.95, max_response_length=10, seed=11)
    tensors = build_rollout_tensors(prompts=PROMPTS, output=out)
    sequences = [row[: int(n)].tolist() for row, n in zip(tensors["input_ids"], tensors["attention_mask"].sum(1))]
    for row, logits in enumerate(_training_logits(config, state_dict, sequences)):
        log_probs = torch.log_softmax(logits.float() / 0.7, dim=-1)
        token_aligned = torch.zeros(tensors["input_ids"].shape[1])
        ids = torch.tensor(sequences[row])
        token_aligned[1 : len(ids)] = log_probs[:-1].gather(1, ids[1:, None]).squeeze(1)
        mask = tensors["loss_mask"][row].bool()
        torch.testing.assert_close(tensors["rollout_log_probs"][row][mask], token_aligned[mask], rtol=1e-4, atol=1e-4)


def test_rollout_batch_repeats_prompt_columns_per_response():
    from verl_balance.rollout import build_rollout_batch

    rollout = _rollout()
    prompts = [[3, 4, 5], [6]]
    out = rollout.generate(prompts, n=3, temperature=1.0, max_response_length=4, seed=0)
    batch = build_rollout_batch(prompts=prompts, output=out, prompt_columns={"uid": ["u0", "u1"], "answer": [7, 8]})
    assert len(batch) == 6
    assert batch.non_tensors["uid"].tolist() == ["u0"] * 3 + ["u1"] * 3
    assert batch.non_tensors["answer"].tolist() == [7] * 3 + [8] * 3
    assert torch.equal(batch["loss_mask"], build_rollout_tensors(prompts=prompts, output=out)["loss_mask"])
    with pytest.raises(RolloutInputError, match="prompt column 'uid' has 1 entries for 2 prompts"):
        build_rollout_batch(prompts=prompts, output=out, prompt_columns={"uid": ["u0"]})


def test_weights_are_referenced_by_default_and_converted_on_request():
    config = _config()
    state_dict = _random_state_dict(config, seed=0)
    shared = KVCacheRollout(model_config=config, state_dict=state_dict)
    assert shared._weights["norm.weight"].data_ptr() == state_dict["norm.weight"].data_ptr()
    half = KVCacheRollout(model_config=config, state_dict=state_dict, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and state_dict["norm.weight"].dtype == torch.float32
    out = half.generate(PROMPTS, temperature=0.0, max_response_length=4)
    assert out.responses.shape == (len(PROMPTS), 4) and out.log_probs.dtype == torch.float32


def test_rollout_reuses_the_model_primitives_instead_of_copies():
    import verl_balance.rollout.kv_cache_generator as module
    from verl_balance.models import llama

    assert module.rms_norm is llama.rms_norm and module.rotate_half is llama.rotate_half
    assert module.rotary_cos_sin is llama.rotary_cos_sin
    assert not hasattr(module, "_Dims")
