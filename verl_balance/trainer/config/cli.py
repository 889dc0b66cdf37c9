"""The recipes' command line: short user errors, exit code 2, the whole console in the run log.

``run_recipe(task, schema=...)`` checks every ``key=value`` override against the recipe's schema
before Hydra composes the config, so a typo (``trainer.total_epoch=2``, with or without Hydra's
``+``) or a misplaced ``+`` on an existing key prints one line naming the key, a "did you mean"
and the section's valid keys. ``user_errors()`` wraps the task: a user error (a bad value, a data
file, a model directory, a checkpoint) prints ``error: <message>`` on stderr and exits with code 2;
a bug keeps its traceback. ``HYDRA_FULL_ERROR=1`` shows the traceback of a user error too.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from verl_balance.trainer.config.checks import ConfigError, did_you_mean

__all__ = ["USER_ERRORS", "check_overrides", "run_recipe", "user_errors"]

USAGE_EXIT_CODE = 2


def _user_error_types() -> tuple[type[BaseException], ...]:
    """The exception classes that are the user's to fix (each message names the key, file or row)."""
    from verl_balance.balance.errors import BalanceInputError
    from verl_balance.data.io import DataError
    from verl_balance.data.synthetic import SyntheticConfigError
    from verl_balance.data.tokenizer import TokenizerError
    from verl_balance.engine.config import EngineConfigError
    from verl_balance.engine.lora import BaseMismatchError
    from verl_balance.models.config import ModelConfigError
    from verl_balance.models.preflight import PreflightError
    from verl_balance.rewards.score import RewardError
    from verl_balance.single_controller.resource_pool import UnplaceableResourcePoolError
    from verl_balance.trainer.checkpoint.resume_policy import ResumeConfigError
    from verl_balance.utils.tracking import TrackingError

    return (
        ConfigError,
        DataError,
        SyntheticConfigError,
        TokenizerError,
        EngineConfigError,
        BaseMismatchError,
        ModelConfigError,
        PreflightError,
        RewardError,
        UnplaceableResourcePoolError,
        ResumeConfigError,
        TrackingError,
        BalanceInputError,
    )


USER_ERRORS = _user_error_types()


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_EXIT_CODE)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A user error (``USER_ERRORS``) -> ``error: <message>`` on stderr and exit code 2 (its
    traceback with HYDRA_FULL_ERROR=1); anything else propagates with its traceback."""
    try:
        yield
    except USER_ERRORS as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _fail(str(err))


def _leaf_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key in node.keys():
        full = f"{prefix}{key}"
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
            keys += _leaf_keys(child, f"{full}.")
        else:
            keys.append(full)
    return keys


def _lookup(root: DictConfig, key: str) -> tuple[bool, DictConfig | None]:
    """(whether ``key`` exists, the deepest typed section on its path); keys under a free dict
    field (e.g. ``reward_kwargs``) always exist."""
    node = root
    for part in key.split("."):
        if not isinstance(node, DictConfig) or node._is_none() or not _is_schema(node):
            return True, None  # a free dict, a list or an unset optional: left to Hydra
        if part not in node:
            return False, node
        node = node._get_node(part)
    return True, None


def _is_schema(node: DictConfig) -> bool:
    import dataclasses

    return dataclasses.is_dataclass(OmegaConf.get_type(node))


def check_overrides(args: Sequence[str], *, schema: type) -> None:
    """Exit 2 (one message, a "did you mean") on a ``key=value`` override of a key ``schema`` does
    not declare, or on ``+key=value`` for a key it declares (Hydra's ``+`` appends a new key)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    lines = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(lines)
    except HydraException:
        return  # a syntax error: Hydra's own message says where
    root = OmegaConf.structured(schema)
    all_keys = _leaf_keys(root)
    for override in overrides:
        key = override.key_or_group
        if override.is_hydra_override() or "/" in key or override.type == OverrideType.DEL:
            continue
        exists, section = _lookup(root, key)
        plain = override.input_line.lstrip("+")
        if exists and override.type == OverrideType.ADD:
            _fail(f"{key} is a key of the recipe already; '+' appends a new key: write {plain}")
        if not exists:
            hint = did_you_mean(key, all_keys)
            where = key.rpartition(".")[0]
            valid = sorted(str(k) for k in section.keys()) if section is not None else []
            _fail(
                f"unknown config key {key!r} (from {override.input_line}){hint}; "
                f"valid keys of {where or 'the root'}: {valid}"
            )


def _has_config_flags(args: Sequence[str]) -> bool:
    flags = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")
    return any(a.split("=")[0] in flags for a in args)


def _verl_command_line(recipe: str) -> str | None:
    """``sys.argv`` with verl's keys written for Hydra to add (``verl_keys.command_line``; the composed
    config translates them); returns the start-up line naming verl's config-group choices it removed."""
    from verl_balance.trainer.config.verl_keys import command_line, startup_line

    try:
        args, groups = command_line(sys.argv[1:], recipe=recipe)
    except ConfigError as err:
        _fail(str(err))
    sys.argv[1:] = args
    return startup_line(groups, recipe=recipe)


def run_recipe(hydra_main: Callable[[], None], *, schema: type, recipe: str) -> None:
    """Let Hydra take verl's keys (``recipe``: 'grpo' or 'sft'), check the command line's other
    overrides against ``schema``, then run the Hydra entry point with the console teed into the run
    log (``utils.run_log``)."""
    from verl_balance.trainer.config.verl_keys import lookup
    from verl_balance.utils import run_log

    line = _verl_command_line(recipe)
    args = sys.argv[1:]
    if not _has_config_flags(args) and os.environ.get("HYDRA_FULL_ERROR") != "1":
        ours = [a for a in args if lookup(a.partition("=")[0].lstrip("+"), recipe=recipe) is None]
        check_overrides(ours, schema=schema)
    with run_log.capture():
        if line:
            print(line, flush=True)
        hydra_main()
