"""VLLMRollout (rollout.name=vllm) against Hugging Face on the same weights, fp32 on CPU.

One engine for the module (an engine start costs ~20-30 s). The references are independent of vLLM:
transformers' own model (``generate`` and a plain forward). Weight updates go through the path the
colocated actor uses (``workers/buckets.stream_full_tensors`` into ``VLLMRollout.load_weights``), with
small buckets so a bucket boundary falls inside decoder layers.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from verl_balance.models.hf import HFModelConfig  # noqa: E402
from verl_balance.models.tiny_hf import write_tiny_model  # noqa: E402
from verl_balance.rollout import build_rollout  # noqa: E402
from verl_balance.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig  # noqa: E402
from verl_balance.workers.buckets import stream_full_tensors  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = [[5, 17, 3, 9, 1], [2], [40, 41, 42], [7, 7, 7, 7, 7, 7, 7], [99, 3]]
LOG_PROB_ATOL = 2e-4
"""fp32: vLLM's CPU kernels (repacked linear layers, its attention) vs transformers' sum in another
order; measured differences are ~1e-5 at this size."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # hidden 128 -> qwen3 head_dim 64, the least vLLM's CPU attention takes
    return write_tiny_model(str(tmp_path_factory.mktemp("vllm") / "qwen3"), family="qwen3", hidden_size=128)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rollout(model_dir, hf_model):
    config = HFModelConfig.from_pretrained(model_dir)
    engine = build_rollout(config, backend="vllm", pad_token_id=0, vllm_config=VLLMRolloutConfig(seed=0))
    assert isinstance(engine, VLLMRollout)
    engine.load_weights(stream_full_tensors(hf_model.state_dict(), bucket_bytes=40_000))
    return engine


def _perturb(model, step: int) -> None:
    """A stand-in for one optimizer step: every weight moves (seeded by ``step``)."""
    gen = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))


def _hf_greedy(model, prompt: list[int], length: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=length, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def _hf_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_greedy_tokens_equal_hf_after_0_1_3_weight_updates_and_differ_without_sync(rollout, hf_model):
    import copy

    model = copy.deepcopy(hf_model)
    applied = 0
    for steps in (0, 1, 3):
        while applied < steps:
            applied += 1
            _perturb(model, applied)
        rollout.load_weights(stream_full_tensors(model.state_dict(), bucket_bytes=40_000))
        out = rollout.generate(PROMPTS, temperature=0.0, max_response_length=12)
        expected = [_hf_greedy(model, p, 12) for p in PROMPTS]
        assert out.response_token_lists() == expected, f"after {steps} updates"
    # negative control: the trainer's weights move, the engine's sync is skipped once
    _perturb(model, 99)
    stale = rollout.generate(PROMPTS, temperature=0.0, max_response_length=12).response_token_lists()
    assert stale != [_hf_greedy(model, p, 12) for p in PROMPTS]
    rollout.load_weights(stream_full_tensors(hf_model.state_dict(), bucket_bytes=40_000))  # restore for others


def test_sampled_log_probs_equal_hf_recomputed_log_probs(rollout, hf_model):
    out = rollout.generate(PROMPTS, n=3, temperature=1.0, max_response_length=10, seeds=list(range(len(PROMPTS))))
    assert out.log_probs is not None
    for row, response in enumerate(out.response_token_lists()):
        prompt = PROMPTS[int(out.prompt_index[row])]
        expected = _hf_log_probs(hf_model, prompt, response)
        got = out.log_probs[row, : len(response)]
        torch.testing.assert_close(got, expected, atol=LOG_PROB_ATOL, rtol=0)
        assert (out.log_probs[row, len(response) :] == 0).all()


def test_row_order_padding_masks_and_stop_tokens(rollout):
    greedy = rollout.generate(PROMPTS, temperature=0.0, max_response_length=8).response_token_lists()
    stop = greedy[0][3]  # prompt 0 stops at its 4th token; the others at their first occurrence, if any
    out = rollout.generate(PROMPTS, n=2, temperature=0.0, max_response_length=8, stop_token_ids=[stop])
    assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    for row, tokens in enumerate(out.response_token_lists()):
        full = greedy[row // 2]
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert tokens == full[:cut]
        assert out.finish_reasons[row] == ("stop" if stop in full else "length")
        length = int(out.response_lengths[row])
        assert out.response_mask[row].tolist() == [1] * length + [0] * (out.responses.shape[1] - length)
        assert (out.responses[row, length:] == 0).all()
    assert out.response_lengths[0] == 4 and out.finish_reasons[0] == "stop"


def test_per_prompt_seeds_make_a_response_independent_of_the_rest_of_the_call(rollout):
    seeds = [11, 22, 33, 44, 55]
    kw = dict(n=2, temperature=1.0, max_response_length=10)
    batched = rollout.generate(PROMPTS, seeds=seeds, **kw).response_token_lists()
    alone = [rollout.generate([p], seeds=[s], **kw).response_token_lists() for p, s in zip(PROMPTS, seeds)]
    assert batched == [row for rows in alone for row in rows]
    reversed_call = rollout.generate(PROMPTS[::-1], seeds=seeds[::-1], **kw).response_token_lists()
    assert reversed_call == [row for rows in alone[::-1] for row in rows]
    # negative control: other seeds, other samples; the two responses of a prompt differ
    other = rollout.generate(PROMPTS, seeds=[s + 1 for s in seeds], **kw).response_token_lists()
    assert other != batched
    assert any(batched[2 * i] != batched[2 * i + 1] for i in range(len(PROMPTS)))


def _memorized(model, ids: list[int], start: int) -> torch.nn.Module:
    """A copy of ``model`` trained until its greedy argmax reproduces ``ids[start:]`` after ``ids[:start]``
    (a stand-in for a policy that has learnt to call the tool)."""
    import copy

    model = copy.deepcopy(model).train()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    inputs, targets = torch.tensor([ids[:-1]]), torch.tensor(ids[start:])
    for _ in range(400):
        logits = model(input_ids=inputs).logits[0, start - 1 :]
        loss = torch.nn.functional.cross_entropy(logits, targets)
        if loss.item() < 0.02 and bool((logits.argmax(-1) == targets).all()):
            return model.eval()
        optim.zero_grad()
        loss.backward()
        optim.step()
    raise AssertionError(f"the conversation was not memorised (loss {loss.item():.3f})")


def test_a_tool_call_round_trip_on_vllm_masks_the_tool_answer(rollout, hf_model, model_dir):
    """verl's tool agent loop (rollout/agent_loop.py) on the vLLM engine: turn 1 calls ``add``, the loop
    runs it and appends its answer through the chat template, turn 2 answers. The reference is the tool
    chat template applied to the whole conversation at once; the log-probs are HF's on the same weights."""
    from transformers import AutoTokenizer

    from verl_balance.models.tiny_hf import TOOL_CHAT_TEMPLATE
    from verl_balance.rollout.agent_loop import ChatRenderer, MultiTurnConfig, ToolAgentLoop
    from verl_balance.tools.base import FunctionTool

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    calls = []

    def add(a: int, b: int) -> int:
        calls.append((a, b))
        return a + b

    user = [{"role": "user", "content": "2+3?"}]
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    conversation = [
        *user,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    whole = tok.apply_chat_template(conversation, tokenize=False)
    assert whole.startswith(prompt) and whole.endswith("<|im_end|>\n")
    whole = whole[: -len("\n")]  # the loop stops at the end-of-turn token
    first_turn_end = whole.index("<|im_end|>", len(prompt)) + len("<|im_end|>")
    observation_end = whole.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n")
    pieces = [whole[len(prompt) : first_turn_end], whole[first_turn_end:observation_end], whole[observation_end:]]
    ids = [tok.encode(p, add_special_tokens=False) for p in (prompt, *pieces)]
    assert sum(ids, []) == tok.encode(whole, add_special_tokens=False)  # the pieces tokenize alone alike
    trained = _memorized(hf_model, sum(ids, []), len(ids[0]))

    # the renderer shows no tool schemas (they would not fit the tiny model's 512 positions); the loop runs add
    renderer = ChatRenderer(tok, tool_schemas=[], eos_token_id=tok.eos_token_id)
    loop = ToolAgentLoop(
        engine=rollout, renderer=renderer, tools={"add": FunctionTool(name="add", fn=add)}, config=MultiTurnConfig()
    )
    run = dict(temperature=0.0, max_response_length=200, stop_token_ids=[tok.eos_token_id], seeds=[0])
    try:
        rollout.load_weights(stream_full_tensors(trained.state_dict(), bucket_bytes=40_000))
        result = loop.generate([user], **run)
    finally:
        rollout.load_weights(stream_full_tensors(hf_model.state_dict(), bucket_bytes=40_000))
    out = result.output
    assert calls == [(2, 3)] and result.tool_calls.tolist() == [1] and result.tool_errors.tolist() == [0]
    assert result.num_turns.tolist() == [4] and result.tokenization_mismatch.tolist() == [0]
    assert out.response_token_lists() == [ids[1] + ids[2] + ids[3]]
    expected_mask = [1] * len(ids[1]) + [0] * len(ids[2]) + [1] * len(ids[3])
    assert out.response_mask[0].tolist() == expected_mask
    model_tokens = torch.tensor(expected_mask, dtype=torch.bool)
    recomputed = _hf_log_probs(trained, ids[0], ids[1] + ids[2] + ids[3])
    torch.testing.assert_close(out.log_probs[0][model_tokens], recomputed[model_tokens], atol=LOG_PROB_ATOL, rtol=0)
    assert (out.log_probs[0][~model_tokens] == 0).all()
    # negative control: the untrained weights make no call, so the response has no hole
    plain = loop.generate([user], **run)
    assert calls == [(2, 3)] and plain.tool_calls.tolist() == [0]
    assert plain.output.response_mask[0].sum() == plain.output.response_lengths[0]
