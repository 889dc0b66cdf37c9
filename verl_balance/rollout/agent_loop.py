"""Multi-turn tool rollouts (verl's ``tool_agent`` loop) on any ``RolloutEngine``.

Each sample is a conversation: generate the assistant turn, parse its tool calls (``multi_turn.format``:
hermes), run them (``tools/runner.py``), append their answers through the chat template, generate
again, until the assistant makes no call, a turn limit is reached or the response budget is used.

Invariants:
- Rows are prompt-major and interleaved like every backend's (row k answers prompt ``k // n``).
- ``responses[k]`` is the whole conversation after the prompt: model tokens and tool-answer tokens
  in order, at most ``max_response_length`` of them; ``response_mask[k, j] = 1`` exactly on tokens
  the model generated (so the loss, the log-probs, advantages, KL and entropy count only those),
  0 on tool answers, the template's turn markers between turns and padding; ``log_probs`` is the
  rollout's log-prob on model tokens, 0 elsewhere.
- The prompt is the chat template of the prompt messages with the tools' schemas and the
  generation prompt; a tool answer's tokens are the template's text after the assistant's
  end-of-turn token up to the next generation prompt, so prompt + response tokens render the same
  conversation as the template applied to all messages (``tokenization_sanity_check_mode``:
  ``strict`` counts every row where they differ in ``multi_turn/tokenization_mismatch``).
- Turn t of row k samples with seed ``row_seed(seed_k, t)``: the same rows, tools and weights give the
  same output whatever the other rows of the call.
- A failing tool (raises, hangs past ``tool_timeout_s``, unknown name, malformed call) answers the
  model with the error text; it is counted, never ends the rollout.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from verl_balance.rollout.base import RolloutEngine, RolloutInputError, RolloutOutput
from verl_balance.tools.hermes import FORMATS, parse_tool_calls
from verl_balance.tools.runner import TRUNCATE_SIDES, run_tool_calls

logger = logging.getLogger(__name__)
SANITY_CHECK_MODES = ("strict", "ignore_strippable", "disable")


@dataclass
class MultiTurnConfig:
    """verl's ``actor_rollout_ref.rollout.multi_turn`` keys (names and defaults), plus ``tool_timeout_s``."""

    enable: bool = False
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_config_path: str | None = None
    function_tool_path: str | None = None
    format: str = "hermes"
    tokenization_sanity_check_mode: str = "strict"
    tool_timeout_s: float = 30.0

    def __post_init__(self):
        checks = {
            "format": (self.format in FORMATS, list(FORMATS)),
            "tool_response_truncate_side": (self.tool_response_truncate_side in TRUNCATE_SIDES, list(TRUNCATE_SIDES)),
            "tokenization_sanity_check_mode": (
                self.tokenization_sanity_check_mode in SANITY_CHECK_MODES,
                list(SANITY_CHECK_MODES),
            ),
        }
        for key, (ok, valid) in checks.items():
            if not ok:
                raise RolloutInputError(
                    f"multi_turn.{key}={getattr(self, key)!r} is not valid; expected one of {valid}"
                )
        for key in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise RolloutInputError(f"multi_turn.{key}={value!r} must be null or an int >= 1")
        for key in ("max_parallel_calls", "max_tool_response_length"):
            if not (isinstance(getattr(self, key), int) and getattr(self, key) >= 1):
                raise RolloutInputError(f"multi_turn.{key}={getattr(self, key)!r} must be an int >= 1")
        if not self.tool_timeout_s > 0:
            raise RolloutInputError(f"multi_turn.tool_timeout_s={self.tool_timeout_s!r} must be > 0")


def row_seed(seed: int, turn: int) -> int:
    """The seed of one row's turn: a hash of (row seed, turn), so turns draw independent numbers."""
    return zlib.crc32(f"{seed}:{turn}".encode()) & 0x7FFFFFFF


@dataclass
class Conversation:
    """One row's state: its messages, the tokens after the prompt and which of them the model wrote."""

    messages: list[dict]
    tools_kwargs: Mapping
    seed: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    tool_rewards: list[float] = field(default_factory=list)
    pending: list = field(default_factory=list)  # the tool calls of the last assistant turn
    finish_reason: str = "stop"
    done: bool = False


@dataclass(frozen=True)
class AgentLoopResult:
    """The rollout output plus per-row turn and tool counts (for metrics)."""

    output: RolloutOutput
    prompts: list[list[int]]  # each row's prompt ids (the chat template with the tools' schemas)
    num_turns: np.ndarray  # (N,) assistant + user turns + 1, verl's count
    tool_calls: np.ndarray
    tool_errors: np.ndarray
    tool_seconds: np.ndarray
    tokenization_mismatches: int

    def metrics(self) -> dict[str, float]:
        return {
            "multi_turn/num_turns/mean": float(self.num_turns.mean()),
            "multi_turn/num_turns/max": float(self.num_turns.max()),
            "multi_turn/tool_calls/mean": float(self.tool_calls.mean()),
            "multi_turn/tool_call_rate": float((self.tool_calls > 0).mean()),
            "multi_turn/tool_errors": float(self.tool_errors.sum()),
            "multi_turn/tool_time_s": float(self.tool_seconds.sum()),
            "multi_turn/tokenization_mismatch": float(self.tokenization_mismatches),
        }


class ChatRenderer:
    """The chat template of a Hugging Face tokenizer, with the run's tool schemas, as token pieces."""

    def __init__(self, hf_tokenizer, *, tool_schemas: Sequence[Mapping], eos_token_id: int):
        if not getattr(hf_tokenizer, "chat_template", None):
            raise RolloutInputError("multi_turn needs a tokenizer with a chat template (model.path's tokenizer)")
        self._tok = hf_tokenizer
        self.tool_schemas = [dict(s) for s in tool_schemas]
        self.eos_text = hf_tokenizer.decode([eos_token_id], skip_special_tokens=False)

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool) -> str:
        return self._tok.apply_chat_template(
            list(messages), tools=self.tool_schemas or None, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, messages: Sequence[Mapping]) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True))

    def observation_ids(self, history: Sequence[Mapping], answers: Sequence[Mapping]) -> list[int]:
        """Tokens the template puts after the last assistant turn's end-of-turn token, through the tool
        answers, up to and including the next generation prompt."""
        before = self.render(history, add_generation_prompt=False)
        after = self.render([*history, *answers], add_generation_prompt=True)
        end = before.rfind(self.eos_text)
        if end < 0 or not after.startswith(before[: end + len(self.eos_text)]):
            raise RolloutInputError(
                "the chat template is not prefix-stable around a tool answer (rendering the conversation "
                "with the tool messages does not start with the conversation before them)"
            )
        return self.encode(after[end + len(self.eos_text) :])


class ToolAgentLoop:
    """verl's ``tool_agent`` loop over a RolloutEngine (see the module invariants)."""

    def __init__(self, *, engine: RolloutEngine, renderer: ChatRenderer, tools: Mapping, config: MultiTurnConfig):
        self.engine, self.renderer, self.tools, self.config = engine, renderer, dict(tools), config

    def generate(
        self,
        conversations: Sequence[Sequence[Mapping]],
        *,
        tools_kwargs: Sequence[Mapping] | None = None,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_response_length: int = 256,
        stop_token_ids: Sequence[int] = (),
        seeds: Sequence[int] | None = None,
        seed: int = 0,
    ) -> AgentLoopResult:
        """``n`` multi-turn responses per conversation (a list of {"role", "content"} messages)."""
        tools_kwargs = tools_kwargs or [{}] * len(conversations)
        rows = []
        for i, messages in enumerate(conversations):
            prompt_ids = self.renderer.prompt_ids(messages)
            base = seeds[i] if seeds is not None else row_seed(seed, i)
            for k in range(n):
                rows.append(
                    Conversation([dict(m) for m in messages], tools_kwargs[i] or {}, row_seed(base, -k - 1), prompt_ids)
                )
        sampling = dict(temperature=temperature, top_p=top_p, stop_token_ids=tuple(stop_token_ids))
        while active := [row for row in rows if not row.done]:
            self._assistant_turn(active, budget=max_response_length, sampling=sampling)
            calling = [row for row in active if not row.done]
            if calling:
                self._tool_turn(calling, budget=max_response_length)
        return self._result(rows, n=n, width=max_response_length)

    def _assistant_turn(self, rows: list[Conversation], *, budget: int, sampling: dict) -> None:
        remaining = [budget - len(row.response_ids) for row in rows]
        out = self.engine.generate(
            [row.prompt_ids + row.response_ids for row in rows],
            n=1,
            max_response_length=max(remaining),
            seeds=[row_seed(row.seed, row.assistant_turns) for row in rows],
            **sampling,
        )
        for row, tokens, lp, room, reason in zip(
            rows, out.response_token_lists(), self._log_prob_lists(out), remaining, out.finish_reasons
        ):
            tokens, lp = tokens[:room], lp[:room]
            row.response_ids += tokens
            row.response_mask += [1] * len(tokens)
            row.log_probs += lp
            row.assistant_turns += 1
            self._after_generation(row, tokens, truncated=len(tokens) >= room, reason=str(reason))

    @staticmethod
    def _log_prob_lists(out: RolloutOutput) -> list[list[float]]:
        if out.log_probs is None:
            return [[0.0] * int(n) for n in out.response_lengths.tolist()]
        return [row[: int(n)] for row, n in zip(out.log_probs.tolist(), out.response_lengths.tolist())]

    def _after_generation(self, row: Conversation, tokens: list[int], *, truncated: bool, reason: str) -> None:
        content, calls = parse_tool_calls(self.renderer.decode(tokens))
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [
                {"type": "function", "function": {"name": c.name or "", "arguments": c.arguments}} for c in calls
            ]
        row.messages.append(message)
        row.pending = calls[: self.config.max_parallel_calls]
        limits = self.config.max_assistant_turns, self.config.max_user_turns
        if truncated or reason == "length":
            row.done, row.finish_reason = True, "length"
        elif not calls:
            row.done = True
        elif (limits[0] and row.assistant_turns >= limits[0]) or (limits[1] and row.user_turns >= limits[1]):
            row.done = True

    def _tool_turn(self, rows: list[Conversation], *, budget: int) -> None:
        results = run_tool_calls(
            [row.pending for row in rows],
            tools=self.tools,
            tools_kwargs=[row.tools_kwargs for row in rows],
            timeout_s=self.config.tool_timeout_s,
            max_parallel_calls=self.config.max_parallel_calls,
            max_tool_response_length=self.config.max_tool_response_length,
            truncate_side=self.config.tool_response_truncate_side,
        )
        for row, answers in zip(rows, results):
            row.tool_calls += len(answers)
            row.tool_errors += sum(a.error is not None for a in answers)
            row.tool_seconds += sum(a.seconds for a in answers)
            row.tool_rewards += [a.reward for a in answers]
            tool_messages = [{"role": "tool", "content": a.text} for a in answers]
            observation = self.renderer.observation_ids(row.messages, tool_messages)
            row.messages += tool_messages
            room = budget - len(row.response_ids)
            row.response_ids += observation[:room]
            row.response_mask += [0] * min(len(observation), room)
            row.log_probs += [0.0] * min(len(observation), room)
            row.user_turns += 1
            if len(observation) >= room:
                row.done, row.finish_reason = True, "length"

    def _result(self, rows: list[Conversation], *, n: int, width: int) -> AgentLoopResult:
        longest = max((len(row.response_ids) for row in rows), default=0)
        pad = self.engine_pad_token_id()
        responses = torch.full((len(rows), longest), pad, dtype=torch.int64)
        mask = torch.zeros((len(rows), longest), dtype=torch.int64)
        log_probs = torch.zeros((len(rows), longest), dtype=torch.float32)
        for k, row in enumerate(rows):
            m = len(row.response_ids)
            responses[k, :m] = torch.tensor(row.response_ids, dtype=torch.int64)
            mask[k, :m] = torch.tensor(row.response_mask, dtype=torch.int64)
            log_probs[k, :m] = torch.tensor(row.log_probs, dtype=torch.float32)
        output = RolloutOutput(
            prompt_index=np.repeat(np.arange(len(rows) // n, dtype=np.int64), n),
            responses=responses,
            response_mask=mask,
            response_lengths=torch.tensor([len(row.response_ids) for row in rows], dtype=torch.int64),
            finish_reasons=np.array([row.finish_reason for row in rows], dtype=object),
            log_probs=log_probs,
        )
        return AgentLoopResult(
            output=output,
            prompts=[row.prompt_ids for row in rows],
            num_turns=np.array([row.assistant_turns + row.user_turns + 1 for row in rows]),
            tool_calls=np.array([row.tool_calls for row in rows]),
            tool_errors=np.array([row.tool_errors for row in rows]),
            tool_seconds=np.array([row.tool_seconds for row in rows]),
            tokenization_mismatches=sum(not self._tokenization_consistent(row) for row in rows),
        )

    def engine_pad_token_id(self) -> int:
        pad = getattr(self.engine, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    def _tokenization_consistent(self, row: Conversation) -> bool:
        mode = self.config.tokenization_sanity_check_mode
        if mode == "disable":
            return True
        ours = self.renderer.decode(row.prompt_ids + row.response_ids, skip_special_tokens=False)
        full = self.renderer.render(row.messages, add_generation_prompt=False)
        if mode == "ignore_strippable":
            ours, full = "".join(ours.split()), "".join(full.split())
        return full.startswith(ours) or ours.startswith(full)
