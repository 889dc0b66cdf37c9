"""The multi-turn tool agent loop (``rollout/agent_loop.py``) against hand-built conversations.

A scripted policy (fixed assistant texts per turn) drives the loop; the reference is the tokenizer's own
chat template applied to the whole conversation at once, which the loop never calls that way.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch

from verl_balance.models import tiny_hf
from verl_balance.rollout.agent_loop import ChatRenderer, MultiTurnConfig, ToolAgentLoop
from verl_balance.rollout.base import RolloutEngine, RolloutInputError, RolloutOutput
from verl_balance.rollout.batch import build_rollout_tensors
from verl_balance.tools import function_tool
from verl_balance.tools.base import FunctionTool
from verl_balance.tools.function_tool import _schema_of


@pytest.fixture(scope="module")
def tok():
    tokenizer = tiny_hf.build_tokenizer()
    tokenizer.chat_template = tiny_hf.TOOL_CHAT_TEMPLATE
    return tokenizer


def call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedRollout(RolloutEngine):
    """Answers turn t of a conversation (found by its user message) with ``script[user][t]`` + eos."""

    def __init__(self, tok, script: dict[str, list[str]]):
        self.tok, self.script, self.pad_token_id = tok, script, tok.pad_token_id
        self.calls: list[int] = []

    def update_weights(self, state_dict):
        pass

    def generate(self, prompts, *, n=1, max_response_length=256, stop_token_ids=(), seeds=None, **_) -> RolloutOutput:
        self.calls.append(len(prompts))
        rows = []
        for prompt in prompts:
            text = self.tok.decode(prompt)
            user = next(u for u in self.script if u in text)
            turn = text.count("<|im_start|>assistant\n") - 1
            rows.append((self.tok.encode(self.script[user][turn]) + [self.tok.eos_token_id])[:max_response_length])
        width = max(len(r) for r in rows)
        responses = torch.full((len(rows), width), self.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for k, r in enumerate(rows):
            responses[k, : len(r)], mask[k, : len(r)] = torch.tensor(r), 1
        return RolloutOutput(
            prompt_index=np.arange(len(rows)),
            responses=responses,
            response_mask=mask,
            response_lengths=torch.tensor([len(r) for r in rows]),
            finish_reasons=np.array(["stop"] * len(rows), dtype=object),
            log_probs=-mask.float(),
        )


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first
        b: the second
    """
    return a * b


def tools_of(*fns) -> dict:
    return {fn.__name__: FunctionTool(name=fn.__name__, fn=fn, tool_schema=_schema_of(fn, fn.__name__)) for fn in fns}


def loop_for(tok, script, tools, **config) -> tuple[ToolAgentLoop, ScriptedRollout]:
    engine = ScriptedRollout(tok, script)
    renderer = ChatRenderer(tok, tool_schemas=[t.tool_schema for t in tools.values()], eos_token_id=tok.eos_token_id)
    return ToolAgentLoop(engine=engine, renderer=renderer, tools=tools, config=MultiTurnConfig(**config)), engine


THREE_TURNS = [call("add", a=2, b=3), call("mul", a=5, b=4), "The answer is 20"]


def test_three_turns_give_the_chat_templates_tokens_and_a_mask_only_on_model_tokens(tok):
    tools = tools_of(add, mul)
    loop, engine = loop_for(tok, {"compute": THREE_TURNS}, tools)
    user = [{"role": "user", "content": "compute (2+3)*4"}]
    result = loop.generate([user], max_response_length=512)

    def assistant(name=None, **arguments):
        calls = [{"type": "function", "function": {"name": name, "arguments": arguments}}] if name else []
        return {"role": "assistant", "content": "" if name else "The answer is 20", "tool_calls": calls}

    messages = [
        *user,
        assistant("add", a=2, b=3),
        {"role": "tool", "content": "5"},
        assistant("mul", a=5, b=4),
        {"role": "tool", "content": "20"},
        assistant(),
    ]
    schemas = [t.tool_schema for t in tools.values()]
    reference = tok.encode(tok.apply_chat_template(messages, tools=schemas, tokenize=False), add_special_tokens=False)
    out = result.output
    ours = result.prompts[0] + out.response_token_lists()[0]
    assert ours == reference[: len(ours)] and tok.decode(reference[len(ours) :]) == "\n"  # the template's last \n
    model_tokens = [tok.encode(text) + [tok.eos_token_id] for text in THREE_TURNS]
    mask = out.response_mask[0, : int(out.response_lengths[0])].tolist()
    assert sum(mask) == sum(len(t) for t in model_tokens)
    # the model's tokens, in order, are exactly the masked ones; the rest are the tool turns' tokens
    assert [tok_id for tok_id, m in zip(out.response_token_lists()[0], mask) if m] == sum(model_tokens, [])
    assert mask[: len(model_tokens[0])] == [1] * len(model_tokens[0]) and mask[len(model_tokens[0])] == 0
    assert (out.log_probs[0] != 0).tolist()[: len(mask)] == [bool(m) for m in mask]  # log-probs on model tokens only
    assert result.tool_calls.tolist() == [2] and result.tool_errors.tolist() == [0]
    assert result.num_turns.tolist() == [6] and result.tokenization_mismatch.tolist() == [0]
    assert engine.calls == [1, 1, 1]


def test_the_training_batch_loss_mask_has_the_tool_holes(tok):
    loop, _ = loop_for(tok, {"compute": THREE_TURNS}, tools_of(add, mul))
    result = loop.generate([[{"role": "user", "content": "compute it"}]], max_response_length=512)
    tensors = build_rollout_tensors(prompts=result.prompts, output=result.output, pad_token_id=tok.pad_token_id)
    plen, rlen = len(result.prompts[0]), int(result.output.response_lengths[0])
    loss_mask = tensors["loss_mask"][0]
    assert loss_mask[:plen].sum() == 0 and loss_mask[plen + rlen :].sum() == 0
    assert loss_mask[plen : plen + rlen].tolist() == result.output.response_mask[0, :rlen].tolist()
    assert 0 < int(loss_mask.sum()) < rlen  # holes: tool answers are context, not targets


def raises(x: int) -> int:
    """Fail.

    Args:
        x: anything
    """
    raise RuntimeError("tool broke")


def hangs(x: int) -> int:
    """Hang.

    Args:
        x: anything
    """
    time.sleep(5)
    return x


def long_answer(x: int) -> str:
    """A long answer.

    Args:
        x: anything
    """
    return "a" * 50 + "b" * 50


@pytest.mark.parametrize(
    "turn, expected_error, expected_text",
    [
        (call("raises", x=1), 1, "Error executing tool 'raises': RuntimeError: tool broke"),
        (call("hangs", x=1), 1, "Error: tool 'hangs' did not answer within 0.3 s"),
        ("<tool_call>\n{not json}\n</tool_call>", 1, "Error: tool call is not valid JSON"),
        (call("nope", x=1), 1, "Error: unknown tool 'nope'"),
        (call("long_answer", x=1), 0, "a" * 5 + "...(truncated)..." + "b" * 5),
    ],
)
def test_a_failing_tool_answers_the_model_and_the_rollout_goes_on(tok, turn, expected_error, expected_text):
    tools = tools_of(raises, hangs, long_answer)
    loop, _ = loop_for(tok, {"go": [turn, "done"]}, tools, tool_timeout_s=0.3, max_tool_response_length=10)
    result = loop.generate([[{"role": "user", "content": "go"}]], max_response_length=1024)
    text = tok.decode(result.output.response_token_lists()[0], skip_special_tokens=True)
    assert expected_text in text and text.endswith("done")  # the model got the answer and went on
    assert result.tool_errors.tolist() == [expected_error] and result.tool_calls.tolist() == [1]


def test_turn_limits_and_the_response_budget_end_a_conversation(tok):
    tools = tools_of(add)
    script = {"loop": [call("add", a=1, b=1)] * 5}
    loop, _ = loop_for(tok, script, tools, max_assistant_turns=2)
    result = loop.generate([[{"role": "user", "content": "loop"}]], max_response_length=2048)
    assert result.num_turns.tolist() == [2 + 1 + 1] and result.tool_calls.tolist() == [1]
    loop, _ = loop_for(tok, script, tools, max_user_turns=1)
    assert loop.generate([[{"role": "user", "content": "loop"}]], max_response_length=2048).tool_calls.tolist() == [1]
    loop, _ = loop_for(tok, script, tools)
    short = loop.generate([[{"role": "user", "content": "loop"}]], max_response_length=40)
    assert int(short.output.response_lengths[0]) == 40 and short.output.finish_reasons.tolist() == ["length"]


def test_rows_are_prompt_major_and_each_conversation_keeps_its_own_script(tok):
    tools = tools_of(add)
    script = {"q-one": [call("add", a=1, b=2), "three"], "q-two": ["no tools"]}
    loop, engine = loop_for(tok, script, tools)
    convs = [[{"role": "user", "content": "q-one"}], [{"role": "user", "content": "q-two"}]]
    result = loop.generate(convs, n=2, max_response_length=512)
    assert result.output.prompt_index.tolist() == [0, 0, 1, 1]
    texts = [tok.decode(r, skip_special_tokens=True) for r in result.output.response_token_lists()]
    assert texts[0] == texts[1] and texts[0].endswith("three") and texts[2] == texts[3] == "no tools"
    assert result.tool_calls.tolist() == [1, 1, 0, 0] and engine.calls == [4, 2]  # one batched call per turn


def test_function_tool_schema_comes_from_the_signature_and_docstring():
    @function_tool("weighted_sum")
    def weighted(values: list[float], weight: float = 1.0) -> float:
        """Sum the values times a weight.

        Args:
            values: numbers to add
            weight: the factor
        """
        return sum(values) * weight

    from verl_balance.tools.function_tool import FUNCTION_TOOLS

    schema = FUNCTION_TOOLS["weighted_sum"].tool_schema["function"]
    assert schema["name"] == "weighted_sum" and schema["description"] == "Sum the values times a weight."
    assert schema["parameters"]["required"] == ["values"]
    assert schema["parameters"]["properties"]["values"] == {
        "type": "array",
        "items": {"type": "number"},
        "description": "numbers to add",
    }


def test_a_bad_multi_turn_value_names_the_key():
    with pytest.raises(RolloutInputError, match="format='json' is not valid"):
        MultiTurnConfig(format="json")
    with pytest.raises(RolloutInputError, match="tool_response_truncate_side"):
        MultiTurnConfig(tool_response_truncate_side="top")
