"""Tokenizers: one small protocol, a built-in byte-level tokenizer, and a Hugging Face wrapper.

Invariants:
- ``apply_chat_template(messages[:k], add_generation_prompt=True)`` is a token prefix of
  ``apply_chat_template(messages[:k+1])`` when message k is an assistant turn; the tokens between
  are that turn's targets (content plus end-of-turn token). The SFT loss mask relies on it.
- Nothing here downloads (Hugging Face tokenizers load with ``local_files_only=True``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

Message = Mapping[str, Any]


class TokenizerError(ValueError):
    """A tokenizer name, path or chat message that cannot be used."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline, rollout and rewards need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model's embedding must hold."""

    @property
    def pad_token_id(self) -> int:
        """Id used for right padding (never a target: its loss_mask is 0)."""

    @property
    def bos_token_id(self) -> int | None:
        """Id prepended to every conversation, or None when the tokenizer has none."""

    @property
    def eos_token_id(self) -> int:
        """End-of-turn id: closes every assistant turn and stops generation."""

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, without special tokens."""

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of token ids; special tokens are dropped unless skip_special_tokens=False."""

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> list[int]:
        """Token ids of a conversation; with add_generation_prompt, ends with the assistant opener.
        A tokenizer that renders tools also takes ``tools=`` and assistant ``tool_calls``."""


ROLES = ("system", "user", "assistant", "tool")


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat and return it as plain dicts: {"role", "content"} (strings), plus verl's ``tool_calls``
    on assistant messages. A ``tool`` message must follow an assistant message with ``tool_calls`` or
    another ``tool`` message; a null ``tool_calls`` is absent, null content with tool calls is ""."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, got {type(messages).__name__}"
        )
    checked: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        calls = _tool_calls(message.get("tool_calls"), index=i, role=role)
        if content is None and calls:
            content = ""
        if not isinstance(role, str) or not isinstance(content, str):
            raise TokenizerError(
                f"message {i} needs string 'role' and 'content', got role={role!r}, content type "
                f"{type(content).__name__}"
            )
        if role not in ROLES:
            raise TokenizerError(f"message {i} has role {role!r}; valid roles: {', '.join(ROLES)}")
        if role == "tool" and not (checked and (checked[-1].get("tool_calls") or checked[-1]["role"] == "tool")):
            raise TokenizerError(
                f"message {i} is a 'tool' message without a preceding call; a tool message must follow an "
                "assistant message with 'tool_calls' (or another tool message)"
            )
        checked.append({"role": role, "content": content, **({"tool_calls": calls} if calls else {})})
        for key in ("name", "tool_call_id"):  # read by some templates (e.g. Llama 3.1, Mistral)
            if isinstance(message.get(key), str):
                checked[-1][key] = message[key]
    return checked


def _tool_calls(calls: Any, *, index: int, role: Any) -> list[dict[str, Any]]:
    """verl's (OpenAI's) ``tool_calls`` of message ``index`` as plain dicts; [] for a null value."""
    if calls is None:
        return []
    where = f"message {index}: 'tool_calls'"
    if role != "assistant":
        raise TokenizerError(f"{where} on a {role!r} message; only assistant messages make tool calls")
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise TokenizerError(
            f"{where} must be a list of {{'type': 'function', 'function': {{'name': str, 'arguments': dict}}}}, "
            f"got {type(calls).__name__}"
        )
    checked = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if not isinstance(name, str) or not name or not isinstance(arguments, (Mapping, str)):
            raise TokenizerError(
                f"{where}[{k}] must be {{'type': 'function', 'function': {{'name': str, 'arguments': dict or "
                f"JSON string}}}}, got {call!r}"
            )
        arguments = dict(arguments) if isinstance(arguments, Mapping) else arguments
        entry = {"type": call.get("type") or "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        checked.append(entry)
    return checked


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    """A row's tool schemas (verl's ``tools`` column: a list of OpenAI function schemas, or null)."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TokenizerError(f"'tools' must be a list of function schemas (dicts) or null, got {type(tools).__name__}")
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TokenizerError(f"'tools'[{k}] must be a function schema (a dict), got {type(tool).__name__}")
    return [dict(tool) for tool in tools] or None


def _refuse_tools(messages: Sequence[Mapping[str, Any]], tools: Any, *, what: str) -> None:
    if tools or any(m.get("tool_calls") for m in messages):
        raise TokenizerError(
            f"{what} cannot render tool schemas or tool calls; use a Hugging Face tokenizer whose chat template "
            "takes tools (e.g. python -m verl_balance.models.tiny_hf --tool-chat-template)"
        )


class ByteTokenizer:
    """UTF-8 bytes plus four specials; vocab_size 260, no files needed.

    Chat format (built at the token level, so no text can forge a special token)::

        [BOS] user text ("\\n" between consecutive non-assistant turns) [SEP] answer [EOS] ...
    """

    NUM_BYTES = 256
    PAD, BOS, EOS, SEP = 256, 257, 258, 259
    _SPECIAL_NAMES = {PAD: "<pad>", BOS: "<bos>", EOS: "<eos>", SEP: "<sep>"}

    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + len(self._SPECIAL_NAMES)

    @property
    def pad_token_id(self) -> int:
        return self.PAD

    @property
    def bos_token_id(self) -> int:
        return self.BOS

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    @property
    def sep_token_id(self) -> int:
        """Assistant-turn opener (the generation prompt)."""
        return self.SEP

    @property
    def name_or_path(self) -> str:
        return "byte"

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of text as ids 0..255."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """UTF-8 text of the byte ids (invalid sequences become U+FFFD); specials shown as <name>."""
        out, pending = [], bytearray()
        for raw in ids:
            token = int(raw)
            if 0 <= token < self.NUM_BYTES:
                pending.append(token)
                continue
            if token not in self._SPECIAL_NAMES:
                raise TokenizerError(f"token id {token} is outside the byte tokenizer's vocab [0, {self.vocab_size})")
            if not skip_special_tokens:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                out.append(self._SPECIAL_NAMES[token])
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = False, tools: Any = None
    ) -> list[int]:
        """Token ids of a conversation in the format of the class docstring (no tools, no tool calls)."""
        messages = validate_messages(messages)
        _refuse_tools(messages, tools, what="the byte tokenizer")
        ids = [self.BOS]
        previous_role = None
        for message in messages:
            if message["role"] == "assistant":
                ids += [self.SEP, *self.encode(message["content"]), self.EOS]
            else:
                if previous_role is not None and previous_role != "assistant":
                    ids += self.encode("\n")
                ids += self.encode(message["content"])
            previous_role = message["role"]
        if add_generation_prompt:
            ids.append(self.SEP)
        return ids

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A local Hugging Face tokenizer behind the ``Tokenizer`` protocol (never downloads).

    Uses the tokenizer's chat template, else a minimal one shaped like ``ByteTokenizer``'s ("\\n" for
    ``[SEP]``). Without a pad token it pads with eos (padding is never a target).
    """

    def __init__(self, path: str, *, trust_remote_code: bool = False):
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise TokenizerError(
                f"tokenizer {path!r} is a Hugging Face tokenizer but `transformers` is not installed; "
                "install it (pip install transformers, a dependency of verl-balance) or use tokenizer 'byte'"
            ) from err
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
        self._path = path
        if self._tok.eos_token_id is None:
            raise TokenizerError(f"tokenizer at {path!r} has no eos token; it is needed to end responses")

    @property
    def hf_tokenizer(self) -> Any:
        """The wrapped transformers tokenizer."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def pad_token_id(self) -> int:
        pad = self._tok.pad_token_id
        return self.eos_token_id if pad is None else int(pad)

    @property
    def bos_token_id(self) -> int | None:
        bos = self._tok.bos_token_id
        return None if bos is None else int(bos)

    @property
    def eos_token_id(self) -> int:
        return int(self._tok.eos_token_id)

    @property
    def name_or_path(self) -> str:
        return self._path

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Message], *, add_generation_prompt: bool = False, tools: Any = None
    ) -> list[int]:
        messages, tools = validate_messages(messages), validate_tools(tools)
        if getattr(self._tok, "chat_template", None):
            return self._encode_with_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        _refuse_tools(messages, tools, what=f"the tokenizer at {self._path!r} has no chat template and")
        ids = [] if self.bos_token_id is None else [self.bos_token_id]
        previous_role = None
        for message in messages:
            if message["role"] == "assistant":
                ids += self.encode("\n") + self.encode(message["content"]) + [self.eos_token_id]
            else:
                if previous_role is not None and previous_role != "assistant":
                    ids += self.encode("\n")
                ids += self.encode(message["content"])
            previous_role = message["role"]
        if add_generation_prompt:
            ids += self.encode("\n")
        return ids

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: Any = None) -> str:
        extra = {"tools": tools} if tools else {}
        return self._tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )

    def _encode_with_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, tools: Any = None
    ) -> list[int]:
        # Encode the rendered text piecewise, cut at every assistant turn's start and end, so that
        # BPE merges never cross a turn boundary and the prefix invariant holds token by token.
        text = self._render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        cuts = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            for prefix in (
                self._render(messages[:k], add_generation_prompt=True, tools=tools) if k else "",
                self._render(messages[: k + 1], add_generation_prompt=False, tools=tools),
            ):
                if not text.startswith(prefix):
                    raise TokenizerError(
                        f"the chat template of {self._path!r} is not prefix-stable at assistant message {k} "
                        "(rendering a shorter conversation is not a prefix of the full one), so the loss "
                        "mask of that turn cannot be located; use prompt/response data or another template"
                    )
                cuts.append(len(prefix))
        bounds = sorted(set([0, *cuts, len(text)]))
        return [tok for start, end in zip(bounds[:-1], bounds[1:]) for tok in self.encode(text[start:end])]

    def __repr__(self) -> str:
        return f"HFTokenizer({self._path!r}, vocab_size={self.vocab_size})"


def build_tokenizer(name_or_path: str | None = "byte", *, trust_remote_code: bool = False) -> Tokenizer:
    """``"byte"`` (or None) -> ByteTokenizer; a local directory -> HFTokenizer. Never downloads."""
    if name_or_path is None or name_or_path == "byte":
        return ByteTokenizer()
    if os.path.isdir(os.path.expanduser(name_or_path)):
        return HFTokenizer(os.path.expanduser(name_or_path), trust_remote_code=trust_remote_code)
    raise TokenizerError(
        f"tokenizer {name_or_path!r} is neither 'byte' nor an existing local directory; "
        "valid values: 'byte' (built-in) or a path to a saved Hugging Face tokenizer (nothing is downloaded)"
    )
