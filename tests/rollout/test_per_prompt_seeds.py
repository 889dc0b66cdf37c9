"""Per-prompt seeds (``generate(..., seeds=[...])``): a prompt's responses are those of a call with
that prompt alone, whatever else is in the batch (other prompts, their order, padding, chunking).

The reference is always a separate single-prompt call; the negative control is the call-wide
``seed=`` (one generator shared by all rows), which must fail the same checks. Exact equality also
needs a row's logits to be the same in any batch; these models' peaked logits leave no sampled
token within rounding of a CDF boundary (deterministically so: the seeds are fixed)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from verl_balance.models import ModelConfig
from verl_balance.rollout import KVCacheRollout, RolloutInputError, sample_next_tokens
from verl_balance.rollout.kv_cache_generator import expected_state_dict_shapes

# Different lengths, so batched calls left-pad every prompt but the longest.
PROMPTS = [[5, 17, 3, 9, 1], [2], [40, 41, 42], [7, 7, 7, 7, 7, 7, 7], [99, 3], [11, 12, 13, 14]]
SEEDS = [101, 7, 2**63 + 5, 0, 123456789, 42]
SAMPLING = dict(n=3, temperature=1.5, top_p=0.9, max_response_length=10)


def _kv_cache_rollout(**kwargs) -> KVCacheRollout:
    config = dataclasses.replace(ModelConfig.preset("tiny"), max_position_embeddings=64)
    gen = torch.Generator().manual_seed(0)
    state = {
        name: (1 + 0.1 * torch.randn(shape, generator=gen))
        if name.endswith("norm.weight")
        else torch.randn(shape, generator=gen) / shape[-1] ** 0.5 * 1.5
        for name, shape in expected_state_dict_shapes(config).items()
    }
    return KVCacheRollout(model_config=config, state_dict=state, **kwargs)


@pytest.fixture(scope="module")
def hf_config(tmp_path_factory):
    pytest.importorskip("transformers")
    from verl_balance.models.hf import HFModelConfig
    from verl_balance.models.tiny_hf import write_tiny_model

    return HFModelConfig.from_pretrained(write_tiny_model(str(tmp_path_factory.mktemp("seeds_hf")), family="qwen2"))


@pytest.fixture(params=["kv_cache", "hf"])
def make_rollout(request):
    """Factory of rollouts of one backend, all with the same weights."""
    if request.param == "kv_cache":
        return _kv_cache_rollout
    from verl_balance.rollout.hf_generator import HFRollout

    config = request.getfixturevalue("hf_config")
    return lambda **kwargs: HFRollout(model_config=config, **kwargs)


def _rows_of(output, prompt: int) -> tuple[list[list[int]], torch.Tensor, list[str]]:
    """Responses, log-probs (trimmed to the longest) and finish reasons of one prompt's rows."""
    rows = (output.prompt_index == prompt).nonzero()[0].tolist()
    responses = [output.response_token_lists()[r] for r in rows]
    width = max(len(r) for r in responses)
    return responses, output.log_probs[rows, :width], [output.finish_reasons[r] for r in rows]


def _assert_same_rows(batched, batched_prompt: int, alone, alone_prompt: int = 0) -> None:
    got, got_lp, got_reasons = _rows_of(batched, batched_prompt)
    want, want_lp, want_reasons = _rows_of(alone, alone_prompt)
    assert got == want
    assert got_reasons == want_reasons
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)


def _stop_token(rollout) -> int:
    """A token the sampled responses do produce, so some rows stop early and leave the batch."""
    out = rollout.generate(PROMPTS, seeds=SEEDS, **SAMPLING)
    return out.response_token_lists()[0][1]


@pytest.mark.parametrize("max_batch_size", [None, 4])
def test_batched_call_with_per_prompt_seeds_equals_one_call_per_prompt(make_rollout, max_batch_size):
    rollout = make_rollout(max_batch_size=max_batch_size)
    stop = [_stop_token(rollout)]
    batched = rollout.generate(PROMPTS, seeds=SEEDS, stop_token_ids=stop, **SAMPLING)
    assert "stop" in batched.finish_reasons and "length" in batched.finish_reasons
    for i, (prompt, seed) in enumerate(zip(PROMPTS, SEEDS)):
        alone = rollout.generate([prompt], seeds=[seed], stop_token_ids=stop, **SAMPLING)
        _assert_same_rows(batched, i, alone)
    # The draws are really random: the 3 responses of a prompt are not all one (greedy) response.
    responses = batched.response_token_lists()
    assert any(len({tuple(r) for r in responses[3 * i : 3 * i + 3]}) > 1 for i in range(len(PROMPTS)))


def test_a_prompts_responses_ignore_the_rest_of_the_call_and_the_shared_seed_does_not(make_rollout):
    rollout = make_rollout()
    full = rollout.generate(PROMPTS, seeds=SEEDS, **SAMPLING)
    order = [4, 2, 0, 5, 3, 1]
    calls = {  # name -> prompt indices of the call
        "reordered": order,
        "removed": [3, 0, 5],
        "added": [0, 1, 2, 3, 4, 5, 1, 3],  # duplicates with the same seeds answer identically too
    }
    for indices in calls.values():
        out = rollout.generate([PROMPTS[i] for i in indices], seeds=[SEEDS[i] for i in indices], **SAMPLING)
        for position, i in enumerate(indices):
            _assert_same_rows(out, position, full, i)

    # Negative control: one generator for the call; reordering changes some prompt's responses.
    shared = rollout.generate(PROMPTS, seed=5, **SAMPLING)
    reordered = rollout.generate([PROMPTS[i] for i in order], seed=5, **SAMPLING)
    changed = [_rows_of(reordered, position)[0] != _rows_of(shared, i)[0] for position, i in enumerate(order)]
    assert any(changed)


def test_response_k_depends_only_on_the_prompt_seed_and_k():
    rollout = _kv_cache_rollout()
    kwargs = dict(temperature=1.5, top_p=0.9, max_response_length=10)
    three = rollout.generate(PROMPTS[:2], seeds=SEEDS[:2], n=3, **kwargs).response_token_lists()
    five = rollout.generate(PROMPTS[:2], seeds=SEEDS[:2], n=5, **kwargs).response_token_lists()
    assert three[:3] == five[:3] and three[3:] == five[5:8]
    other_seed = rollout.generate(PROMPTS[:2], seeds=[SEEDS[0] + 1, SEEDS[1]], n=3, **kwargs).response_token_lists()
    assert other_seed[3:] == three[3:] and other_seed[:3] != three[:3]


def test_greedy_ignores_seeds_and_equals_the_unseeded_call():
    rollout = _kv_cache_rollout()
    greedy = rollout.generate(PROMPTS, temperature=0.0, max_response_length=8)
    seeded = rollout.generate(PROMPTS, temperature=0.0, max_response_length=8, seeds=SEEDS)
    assert torch.equal(greedy.responses, seeded.responses)


def test_bad_seeds_raise_naming_the_entry():
    generate = functools.partial(_kv_cache_rollout().generate, max_response_length=4)
    with pytest.raises(RolloutInputError, match="one per prompt"):
        generate(PROMPTS, seeds=SEEDS[:-1])
    with pytest.raises(RolloutInputError, match=r"seeds\[1\]"):
        generate(PROMPTS[:2], seeds=[1, -1])
    with pytest.raises(RolloutInputError, match=r"seeds\[0\]"):
        generate(PROMPTS[:1], seeds=[2**64])
    with pytest.raises(RolloutInputError, match="not both"):
        generate(PROMPTS[:1], seeds=[1], seed=1)


# ---------------------------------------------------------------- inverse-CDF sampler
PROBS = [0.5, 0.3, 0.15, 0.05]


@pytest.mark.parametrize("top_p,kept", [(0.45, [0]), (0.7, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_evenly_spaced_uniforms_hit_each_token_in_proportion_to_its_renormalised_probability(top_p, kept):
    # Shuffled token order: the sampler must not rely on ids being sorted by probability.
    ids = torch.tensor([2, 0, 3, 1])
    logits = torch.tensor(PROBS)[ids].log().repeat(1000, 1)
    uniforms = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000  # a deterministic "sample"
    tokens, log_probs = sample_next_tokens(logits, temperature=1.0, top_p=top_p, uniforms=uniforms)
    mass = sum(PROBS[i] for i in kept)
    counts = torch.bincount(ids[tokens], minlength=4).tolist()
    assert counts == pytest.approx([1000 * PROBS[i] / mass if i in kept else 0 for i in range(4)], abs=1)
    torch.testing.assert_close(log_probs, logits[0, tokens])  # the untruncated policy's log-prob


def test_extreme_uniforms_never_pick_a_zero_probability_token():
    logits = torch.tensor([[0.0, 0.0, float("-inf"), float("-inf")], [float("-inf"), 0.0, 0.0, float("-inf")]])
    for u in (0.0, 1 - 2**-53):
        tokens, _ = sample_next_tokens(
            logits, temperature=1.0, top_p=1.0, uniforms=torch.full((2,), u, dtype=torch.float64)
        )
        assert tokens.tolist() == ([0, 1] if u == 0 else [1, 2])


def test_each_row_is_decided_by_its_own_uniform_alone():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    uniforms = torch.rand(6, generator=gen, dtype=torch.float64)
    together, _ = sample_next_tokens(logits, temperature=0.8, top_p=0.9, uniforms=uniforms)
    alone = [
        sample_next_tokens(logits[r : r + 1], temperature=0.8, top_p=0.9, uniforms=uniforms[r : r + 1])[0].item()
        for r in range(6)
    ]
    assert together.tolist() == alone


def test_blocked_row_streams_read_each_rows_stream_in_order_as_rows_finish():
    from verl_balance.rollout.sampling import RowRandomStreams

    seeds, n, steps = [3, 2**64 - 1], 2, 10
    # Reference: the documented stream of row (prompt i, response k), read in one go.
    expected = torch.tensor(
        np.stack(
            [
                np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, k]))).random(steps)
                for seed in seeds
                for k in range(n)
            ]
        )
    )
    uniforms = RowRandomStreams(seeds=seeds, n=n).for_rows(1, 3, device=torch.device("cpu"), block_steps=3)
    running = torch.arange(3)  # call rows 1, 2, 3
    for step in range(steps):
        if step == 4:
            running = running[[0, 2]]  # call row 2 finished: its stream is no longer read
        if step == 7:
            running = running[[1]]
        torch.testing.assert_close(uniforms(running, step), expected[1 + running, step], rtol=0, atol=0)
