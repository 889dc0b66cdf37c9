"""Start-up checks of a model directory, run by the trainers before Ray starts; each raises
``PreflightError`` naming the file (or key) and what would be valid.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from dataclasses import dataclass

from verl_balance.data.tokenizer import Tokenizer, TokenizerError, build_tokenizer

logger = logging.getLogger(__name__)

BUILTIN_CHAT_TEMPLATE = "builtin"
"""The ``custom_chat_template`` value that opts in to the built-in minimal chat template."""
# Any one of these makes a Hugging Face tokenizer directory loadable (fast, sentencepiece, BPE, wordpiece).
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
_PROBE_TEXT = "hello world 123"


class PreflightError(ValueError):
    """A model or tokenizer directory that cannot be used; names the file and what would be valid."""


@dataclass(frozen=True)
class ModelDirSpec:
    """What a trainer is about to load: model directory, tokenizer, and how chats are rendered."""

    key_prefix: str
    """Prefix of the model keys in errors (``model.`` or ``actor_rollout_ref.model.``)."""
    model_path: str | None
    """The HF model directory (``model.path``); None = a built-in preset."""
    tokenizer_path: str
    """'byte' or a tokenizer directory (``model.tokenizer``, else ``model.path``)."""
    init: str = "pretrained"
    """'pretrained' reads the directory's weights (checked); 'random' does not."""
    custom_chat_template: str | None = None
    """None (the tokenizer's own template is required) or ``BUILTIN_CHAT_TEMPLATE``."""
    chat_key: str | None = None
    """The data key whose values are rendered as chats (e.g. ``data.messages_key``); None = no chats."""


def preflight_model_dir(spec: ModelDirSpec) -> Tokenizer:
    """Run every check on ``spec``; returns the loaded tokenizer. Raises PreflightError."""
    tokenizer = check_tokenizer(spec.tokenizer_path, key=f"{spec.key_prefix}tokenizer")
    check_chat_template(
        tokenizer,
        tokenizer_path=spec.tokenizer_path,
        chat_key=spec.chat_key,
        custom_chat_template=spec.custom_chat_template,
        key=f"{spec.key_prefix}custom_chat_template",
    )
    if spec.model_path is not None and spec.init == "pretrained":
        check_weight_files(os.path.expanduser(spec.model_path), key=f"{spec.key_prefix}path")
    return tokenizer


# ---------------------------------------------------------------------- tokenizer
def check_tokenizer(path: str, *, key: str) -> Tokenizer:
    """The tokenizer at ``path`` ('byte' or a directory), checked to load and to encode text."""
    if path == "byte":
        return build_tokenizer("byte")
    directory = os.path.expanduser(path)
    if os.path.isdir(directory):
        present = [name for name in VOCABULARY_FILES if os.path.isfile(os.path.join(directory, name))]
        if not present:
            raise PreflightError(
                f"{key}={path!r}: the directory has no tokenizer vocabulary file (none of "
                f"{list(VOCABULARY_FILES)}; found {sorted(os.listdir(directory))}); copy the tokenizer "
                "files (save_pretrained output) into it or point the key at a tokenizer directory"
            )
        if "tokenizer.json" in present:
            _check_json_file(os.path.join(directory, "tokenizer.json"), key=key)
        config_file = os.path.join(directory, "tokenizer_config.json")
        if os.path.isfile(config_file):
            _check_json_file(config_file, key=key)
    try:
        tokenizer = build_tokenizer(path)
    except TokenizerError as err:
        raise PreflightError(f"{key}={path!r}: {err}") from err
    except Exception as err:  # transformers raises many types for a broken directory
        raise PreflightError(f"{key}={path!r}: the tokenizer cannot be loaded: {type(err).__name__}: {err}") from err
    if not tokenizer.encode(_PROBE_TEXT):
        raise PreflightError(
            f"{key}={path!r}: the tokenizer loads but encodes {_PROBE_TEXT!r} to no tokens (vocabulary size "
            f"{tokenizer.vocab_size}); its vocabulary files are missing or broken"
        )
    return tokenizer


def _check_json_file(path: str, *, key: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise PreflightError(f"{key}: {path} is not a readable JSON file ({err})") from err


def check_chat_template(
    tokenizer: Tokenizer, *, tokenizer_path: str, chat_key: str | None, custom_chat_template: str | None, key: str
) -> None:
    """A chat template must be present for chat data unless ``custom_chat_template=builtin``."""
    hf = getattr(tokenizer, "hf_tokenizer", None)
    has_template = hf is None or bool(getattr(hf, "chat_template", None))  # the byte tokenizer has its own
    if custom_chat_template not in (None, BUILTIN_CHAT_TEMPLATE):
        raise PreflightError(
            f"{key}: only null (the tokenizer's own template) or {BUILTIN_CHAT_TEMPLATE!r} (the built-in "
            "minimal template) are supported; to use another Jinja template, put it in the tokenizer "
            "directory (chat_template.jinja) so checkpoints and exports carry it"
        )
    if custom_chat_template == BUILTIN_CHAT_TEMPLATE:
        if hf is not None and has_template:
            raise PreflightError(
                f"{key}={BUILTIN_CHAT_TEMPLATE} but the tokenizer {tokenizer_path!r} has its own chat template, "
                f"which is used; remove {key}"
            )
        if hf is not None:
            logger.warning("%s=builtin: rendering chats with the built-in template (%s has none)", key, tokenizer_path)
        return
    if chat_key is not None and not has_template:
        raise PreflightError(
            f"{chat_key} is set, so samples are rendered as chats, but the tokenizer {tokenizer_path!r} has no "
            f"chat template (no chat_template.jinja, no chat_template in tokenizer_config.json); add one to "
            f"the directory, or set {key}={BUILTIN_CHAT_TEMPLATE} to use the built-in minimal template "
            "(different tokens, so a different loss, than the model's own format)"
        )


# ---------------------------------------------------------------------- weights
def check_weight_files(model_dir: str, *, key: str) -> None:
    """Every safetensors file of ``model_dir`` (and every shard its index names) is present and whole."""
    index_file = os.path.join(model_dir, SAFETENSORS_INDEX)
    files = sorted(name for name in os.listdir(model_dir) if name.endswith(".safetensors"))
    if os.path.isfile(index_file):
        try:
            with open(index_file, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise PreflightError(f"{key}={model_dir!r}: {index_file} is not a safetensors index ({err})") from err
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise PreflightError(
                f"{key}={model_dir!r}: {index_file} names shard(s) that are missing: "
                f"{[os.path.join(model_dir, s) for s in missing]}"
            )
    if not os.path.isfile(index_file) and SAFETENSORS_SINGLE not in files:
        has_bin = any(name.startswith("pytorch_model") and name.endswith(".bin") for name in os.listdir(model_dir))
        found = f"only {files}" if files else ("only pytorch_model*.bin" if has_bin else "no weights (no safetensors)")
        raise PreflightError(
            f"{key}={model_dir!r} has {found}: the engine reads {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} with "
            "its shards (write them with save_pretrained(dir, safe_serialization=True)), or set "
            f"{key.rsplit('.', 1)[0]}.init=random to train that architecture from random weights"
        )
    for name in files:
        check_safetensors_file(os.path.join(model_dir, name))


def check_safetensors_file(path: str) -> None:
    """A safetensors file's header parses and the file holds every byte its ``data_offsets`` declare."""
    size = os.path.getsize(path)
    if size < 8:
        raise PreflightError(f"{path}: {size} bytes, too short for a safetensors file (truncated or empty)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise PreflightError(
                f"{path}: header declares {header_len} bytes but the file has {size} bytes in all "
                "(truncated or not a safetensors file)"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        ends = [int(info["data_offsets"][1]) for name, info in header.items() if name != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise PreflightError(f"{path}: the safetensors header cannot be parsed ({err}); the file is corrupt") from err
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        what = "truncated" if size < expected else "longer than its header declares"
        raise PreflightError(
            f"{path}: {what}: the header declares {expected} bytes ({len(ends)} tensors), the file has {size} "
            "bytes; copy or download it again"
        )
