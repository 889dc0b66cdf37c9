"""Tokenizers: one small protocol, a built-in byte-level tokenizer, and a Hugging Face wrapper.

Invariants:
- ``apply_chat_template(messages[:k], add_generation_prompt=True)`` is a token prefix of
  ``apply_chat_template(messages[:k+1])`` when message k is an assistant turn, and the tokens
  between the two are exactly that turn's target tokens (its content plus the end-of-turn token).
  The SFT dataset relies on this to build the loss mask, so every tokenizer here keeps it.
- Nothing here downloads: the byte tokenizer needs no files, and the Hugging Face wrapper loads
  from a local directory only (``local_files_only=True``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

Message = Mapping[str, str]


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
        """Token ids of a conversation; with add_generation_prompt, ends with the assistant opener."""


def validate_messages(messages: Any) -> list[dict[str, str]]:
    """Check a chat (list of {"role", "content"} with string values) and return it as plain dicts."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, got {type(messages).__name__}"
        )
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TokenizerError(f"message {i} must be a dict with 'role' and 'content', got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TokenizerError(
                f"message {i} needs string 'role' and 'content', got role={role!r}, content type "
                f"{type(content).__name__}"
            )
        if role not in ("system", "user", "assistant", "tool"):
            raise TokenizerError(f"message {i} has role {role!r}; valid roles: system, user, assistant, tool")
        checked.append({"role": role, "content": content})
    return checked


class ByteTokenizer:
    """UTF-8 bytes plus four specials; vocab_size 260, no files needed.

    Chat format, built at the token level so no text can forge a special token::

        [BOS] user text ("\\n" between consecutive non-assistant turns) [SEP] answer [EOS] ...

    ``[SEP]`` opens an assistant turn (the generation prompt); ``[EOS]`` closes it.
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

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> list[int]:
        """Token ids of a conversation in the format of the class docstring."""
        ids = [self.BOS]
        previous_role = None
        for message in validate_messages(messages):
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

    Uses the tokenizer's own chat template when it has one (rendered to text, then encoded, then
    checked for the prefix invariant by the SFT dataset); otherwise a minimal template with the
    same structure as ``ByteTokenizer``'s, "\\n" standing in for ``[SEP]``.
    A tokenizer without a pad token pads with its eos token (padding is never a target).
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

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> list[int]:
        messages = validate_messages(messages)
        if getattr(self._tok, "chat_template", None):
            return self._encode_with_template(messages, add_generation_prompt=add_generation_prompt)
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

    def _render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        return self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)

    def _encode_with_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> list[int]:
        # Encode the rendered text piecewise, cut at every assistant turn's start and end, so that
        # BPE merges never cross a turn boundary and the prefix invariant holds token by token.
        text = self._render(messages, add_generation_prompt=add_generation_prompt)
        cuts = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            for prefix in (
                self._render(messages[:k], add_generation_prompt=True) if k else "",
                self._render(messages[: k + 1], add_generation_prompt=False),
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
