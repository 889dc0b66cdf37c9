"""Validation helpers of the recipe configs: ``ConfigError`` and the checks that name the user's key.

Each check raises ``ConfigError`` naming the key (a section's own field name inside
``__post_init__``, written out in full by ``typed.to_typed``) and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re

from verl_balance.models.hf import REFUSED_MODEL_TYPES, SUPPORTED_MODEL_TYPES

__all__ = [
    "MAX_CONFIG_MAGNITUDE",
    "ConfigError",
    "check_adapter_dir",
    "check_choice",
    "check_finite_values",
    "check_hf_model_dir",
    "check_layout",
    "check_positive",
    "check_remove_padding",
    "check_writable_dir",
    "did_you_mean",
    "qualify",
]


class ConfigError(ValueError):
    """A config key has an invalid value or an invalid combination with another key."""


def did_you_mean(name, choices) -> str:
    """`` (did you mean 'x'?)`` for the near misses of ``name`` among ``choices``; "" when none is near."""
    choices, name = [str(c) for c in choices], str(name)
    section, _, leaf = name.rpartition(".")
    near = []
    if section:
        near += [c for c in choices if c.rpartition(".")[2] == leaf]
        siblings = {c.rpartition(".")[2]: c for c in choices if c.rpartition(".")[0] == section}
        near += [siblings[m] for m in difflib.get_close_matches(leaf, list(siblings), n=2, cutoff=0.7)]
    near += difflib.get_close_matches(name, choices, n=3, cutoff=0.8)
    near = [c for c in dict.fromkeys(near) if c != name]
    return " (did you mean " + " or ".join(repr(c) for c in near[:3]) + "?)" if near else ""


def check_choice(key: str, value, allowed) -> None:
    """Raise ConfigError naming ``key`` unless ``value`` is one of ``allowed`` (with a "did you mean")."""
    if value not in allowed:
        hint = did_you_mean(value, allowed) if isinstance(value, str) else ""
        raise ConfigError(f"{key}={value!r} is not valid{hint}; expected one of {list(allowed)}")


def check_positive(key: str, value) -> None:
    """Raise ConfigError naming ``key`` unless ``value`` is a positive number."""
    if value is None or value <= 0:
        raise ConfigError(f"{key}={value!r} must be a positive number")


def check_remove_padding(key: str, value: bool) -> None:
    """Reject use_remove_padding=false: the engine always runs packed sequences."""
    if not value:
        raise ConfigError(
            f"{key}=false is not supported: the engine always runs packed (padding-free) "
            "sequences, which Ulysses sequence parallelism requires"
        )


def check_hf_model_dir(key: str, path: str) -> None:
    """Raise ConfigError naming ``key`` unless ``path`` is a local HF model directory of a supported family."""
    config_file = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(config_file):
        raise ConfigError(
            f"{key}={path!r} is not a local Hugging Face directory (no config.json); point {key} at "
            f"a save_pretrained output of a checkpoint of one of {list(SUPPORTED_MODEL_TYPES)} (nothing is "
            "downloaded)"
        )
    try:
        with open(config_file, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError(f"{key}={path!r}: config.json cannot be read ({err})") from err
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = REFUSED_MODEL_TYPES.get(model_type)
        raise ConfigError(
            f"{key}={path!r} has model_type={model_type!r}, which is not supported{' (' + why + ')' if why else ''}; "
            f"supported model_type values: {list(SUPPORTED_MODEL_TYPES)}"
        )


def check_adapter_dir(key: str, path: str) -> None:
    """A peft adapter directory (``save_pretrained`` of a PeftModel): its config and weights exist."""
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not os.path.isfile(os.path.join(path, name)):
            raise ConfigError(
                f"{key}={path!r} has no {name}: point it at a peft adapter directory (save_pretrained of a "
                "PeftModel, or python -m verl_balance.export of a LoRA checkpoint), or remove the key"
            )


def check_writable_dir(key: str, path: str) -> None:
    """Raise ConfigError naming ``key`` unless ``path`` is (or can be created as) a writable directory."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        why = "is not a directory" if not os.path.isdir(probe) else "is not writable"
        raise ConfigError(f"{key}={path!r} cannot be used: {probe!r} {why}; point {key} at a writable directory")


def check_layout(*, sp_size: int, world_size: int, sp_key: str) -> int:
    """The DP size; ConfigError unless the Ulysses degree divides the worker count."""
    if world_size % sp_size:
        raise ConfigError(
            f"{sp_key}={sp_size} must divide the number of workers trainer.nnodes * trainer.n_gpus_per_node = "
            f"{world_size}"
        )
    return world_size // sp_size


MAX_CONFIG_MAGNITUDE = 1e9
"""The largest magnitude a declared float key may hold (values near 1e308 overflow on first use)."""


def check_finite_values(value, key: str = "", *, declared: bool = True) -> None:
    """Raise ConfigError naming the first key (dotted, list index ``[i]``) under ``value`` that holds inf or nan,
    or a declared float beyond +-MAX_CONFIG_MAGNITUDE (free dicts' values need only be finite)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value} is not a finite number; give a finite value")
    if isinstance(value, float) and declared and abs(value) > MAX_CONFIG_MAGNITUDE:
        raise ConfigError(
            f"{key}={value!r} is out of range: no setting here is meaningful beyond +-{MAX_CONFIG_MAGNITUDE:g}; "
            "give a smaller value"
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            check_finite_values(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, dict):
        for name, item in value.items():
            check_finite_values(item, f"{key}.{name}" if key else str(name), declared=False)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_finite_values(item, f"{key}[{i}]", declared=declared)


def qualify(message: str, prefixes: dict[str, str]) -> str:
    """``message`` with every bare key name in ``prefixes`` written as its full key."""
    if not prefixes:
        return message
    names = "|".join(sorted(map(re.escape, prefixes), key=len, reverse=True))
    return re.sub(rf"(?<![\w.'\"])({names})\b", lambda m: prefixes[m.group(1)] + m.group(1), message)
