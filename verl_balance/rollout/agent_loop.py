"""Multi-turn tool rollouts (verl's ``tool_agent`` loop) on any ``RolloutEngine``.

Each sample is a conversation: generate, run the turn's tool calls, append their answers through the
chat template, generate again, until no call, a turn limit or the response budget ends it.

Invariants:
- Rows are prompt-major and interleaved like every backend's (row k answers prompt ``k // n``).
- ``responses[k]`` is the conversation after the prompt (model and tool-answer tokens, at most
  ``max_response_length``); ``response_mask[k, j] = 1`` exactly on model-generated tokens; ``log_probs``
  is the rollout's log-prob there, 0 elsewhere.
- Prompt + response tokens render the same conversation as the chat template applied to all messages
  (``tokenization_sanity_check_mode=strict`` counts rows where they differ).
- Turn t of row k samples with seed ``row_seed(seed_k, t)``: independent of the call's other rows.
- A failing tool (raises, times out, unknown name, malformed call) answers with the error text; it is
  counted, never ends the rollout.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from verl_balance.rollout.base import RolloutEngine, RolloutInputError, RolloutOutput
from verl_balance.tools.hermes import FORMATS, parse_tool_calls
from verl_balance.tools.runner import TRUNCATE_SIDES, run_tool_calls

logger = logging.getLogger(__name__)
SANITY_CHECK_MODES = ("strict", "ignore_strippable", "disable")
# verl's agent_name values of a sample (its dataset column): the tool loop, or one plain turn.
TOOL_AGENT, SINGLE_TURN_AGENT = "tool_agent", "single_turn_agent"
AGENT_NAME_KEY = "agent_name"
AGENT_NAMES = (TOOL_AGENT, SINGLE_TURN_AGENT)


def check_agent_name(name: str | None) -> None:
    if name is not None and name not in AGENT_NAMES:
        raise RolloutInputError(f"agent_name={name!r} is not valid; expected one of {list(AGENT_NAMES)} (or null)")


@dataclass
class MultiTurnConfig:
    """verl's ``actor_rollout_ref.rollout.multi_turn`` keys (names and defaults), plus ``tool_timeout_s``."""

    enable: bool = False
    """Roll out conversations with tool calls (verl's tool agent loop) instead of one response."""
    max_assistant_turns: Optional[int] = None
    """Most assistant turns of a conversation (null: until the response budget ends it)."""
    max_user_turns: Optional[int] = None
    """Most tool-answer turns of a conversation (null: no limit)."""
    max_parallel_calls: int = 1
    """Tool calls of one assistant turn that run (concurrently); later calls of the turn are dropped."""
    max_tool_response_length: int = 256
    """Characters of a tool's answer kept (errors are never cut)."""
    tool_response_truncate_side: str = "middle"
    """Where a long answer is cut: left, middle or right."""
    tool_config_path: Optional[str] = None
    """A YAML of tool classes (verl's format: tools: [{class_name, config, tool_schema}])."""
    function_tool_path: Optional[str] = None
    """A Python file of @function_tool functions (ours or verl's decorator)."""
    format: str = "hermes"
    """Tool-call format of the chat template (hermes: <tool_call>{json}</tool_call>)."""
    tokenization_sanity_check_mode: str = "strict"
    """strict / ignore_strippable: count rows whose turn-by-turn tokens differ from the whole chat's
    template (multi_turn/tokenization_mismatch); disable: skip the check."""
    tool_timeout_s: float = 30.0
    """Seconds one tool call may take before it is answered with a timeout error (ours; verl has none)."""

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
                raise RolloutInputError(f"{key}={getattr(self, key)!r} is not valid; expected one of {valid}")
        for key in ("max_assistant_turns", "max_user_turns"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, int) and value >= 1):
                raise RolloutInputError(f"{key}={value!r} must be null or an int >= 1")
        for key in ("max_parallel_calls", "max_tool_response_length"):
            if not (isinstance(getattr(self, key), int) and getattr(self, key) >= 1):
                raise RolloutInputError(f"{key}={getattr(self, key)!r} must be an int >= 1")
        if not self.tool_timeout_s > 0:
            raise RolloutInputError(f"tool_timeout_s={self.tool_timeout_s!r} must be > 0")


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
    single_turn: bool = False  # verl's agent_name=single_turn_agent: one assistant turn, no tools
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
    tokenization_mismatch: np.ndarray  # (N,) 1 where turn-by-turn tokens differ from the whole chat's

    def turn_stats(self) -> dict[str, np.ndarray]:
        return {
            "num_turns": self.num_turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "tool_seconds": self.tool_seconds,
            "tokenization_mismatch": self.tokenization_mismatch,
        }

    def rollout_output(self) -> RolloutOutput:
        """The output with each row's prompt and turn counts attached (what a worker returns)."""
        return dataclasses.replace(self.output, prompts=self.prompts, turn_stats=self.turn_stats())


def multi_turn_metrics(columns: Mapping) -> dict[str, float]:
    """The step's multi-turn figures from a batch's per-row turn columns ({} for a single-turn batch)."""
    if "num_turns" not in columns:
        return {}
    turns, calls = np.asarray(columns["num_turns"], dtype=float), np.asarray(columns["tool_calls"], dtype=float)
    return {
        "multi_turn/num_turns/mean": float(turns.mean()),
        "multi_turn/num_turns/max": float(turns.max()),
        "multi_turn/tool_calls/mean": float(calls.mean()),
        "multi_turn/tool_call_rate": float((calls > 0).mean()),
        "multi_turn/tool_errors": float(np.sum(columns["tool_errors"])),
        "multi_turn/tool_time_s": float(np.sum(columns["tool_seconds"])),
        "multi_turn/tokenization_mismatch": float(np.sum(columns["tokenization_mismatch"])),
    }


class ChatRenderer:
    """The chat template of a Hugging Face tokenizer, with the run's tool schemas, as token pieces."""

    def __init__(self, hf_tokenizer, *, tool_schemas: Sequence[Mapping], eos_token_id: int):
        if not getattr(hf_tokenizer, "chat_template", None):
            raise RolloutInputError("multi_turn needs a tokenizer with a chat template (model.path's tokenizer)")
        self._tok = hf_tokenizer
        self.tool_schemas = [dict(s) for s in tool_schemas]
        self.eos_text = hf_tokenizer.decode([eos_token_id], skip_special_tokens=False)

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool, with_tools: bool = True) -> str:
        tools = self.tool_schemas if with_tools and self.tool_schemas else None
        return self._tok.apply_chat_template(
            list(messages), tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, messages: Sequence[Mapping], *, with_tools: bool = True) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True, with_tools=with_tools))

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
        agent_names: Sequence[str | None] | None = None,
    ) -> AgentLoopResult:
        """``n`` multi-turn responses per conversation (a list of {"role", "content"} messages);
        ``agent_names[i]``: verl's ``agent_name`` of the sample (``single_turn_agent``: one turn)."""
        tools_kwargs = tools_kwargs or [{}] * len(conversations)
        agent_names = agent_names or [None] * len(conversations)
        rows = []
        for i, messages in enumerate(conversations):
            check_agent_name(agent_names[i])
            single = agent_names[i] == SINGLE_TURN_AGENT
            prompt_ids = self.renderer.prompt_ids(messages, with_tools=not single)
            base = seeds[i] if seeds is not None else row_seed(seed, i)
            for k in range(n):
                row = Conversation(
                    [dict(m) for m in messages], tools_kwargs[i] or {}, row_seed(base, -k - 1), prompt_ids
                )
                row.single_turn = single
                rows.append(row)
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
        if row.single_turn:
            calls = []
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
            tokenization_mismatch=np.array([int(not self._tokenization_consistent(row)) for row in rows]),
        )

    def engine_pad_token_id(self) -> int:
        pad = getattr(self.engine, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    def _tokenization_consistent(self, row: Conversation) -> bool:
        mode = self.config.tokenization_sanity_check_mode
        if mode == "disable":
            return True
        ours = self.renderer.decode(row.prompt_ids + row.response_ids, skip_special_tokens=False)
        full = self.renderer.render(row.messages, add_generation_prompt=False, with_tools=not row.single_turn)
        if mode == "ignore_strippable":
            ours, full = "".join(ours.split()), "".join(full.split())
        return full.startswith(ours) or ours.startswith(full)


def build_agent_loop(
    *,
    engine: RolloutEngine,
    config: MultiTurnConfig,
    tokenizer_path: str | None,
    chat_template: str | None,
    eos_token_id: int,
) -> ToolAgentLoop:
    """The loop of a rollout worker: its engine, the run's tools (loaded in this process) and the
    tokenizer of ``tokenizer_path`` with the driver's chat template."""
    from transformers import AutoTokenizer

    from verl_balance.tools import load_tools
    from verl_balance.tools.base import check_schema

    if tokenizer_path is None:
        raise RolloutInputError("multi_turn needs a Hugging Face model directory (model.path) with a tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tools = load_tools(tool_config_path=config.tool_config_path, function_tool_path=config.function_tool_path)
    schemas = [check_schema(tool.tool_schema, where=name) for name, tool in tools.items()]
    renderer = ChatRenderer(tokenizer, tool_schemas=schemas, eos_token_id=eos_token_id)
    return ToolAgentLoop(engine=engine, renderer=renderer, tools=tools, config=config)
