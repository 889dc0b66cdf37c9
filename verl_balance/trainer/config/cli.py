"""The recipes' command line: short user errors, exit code 2, the whole console in the run log.

``run_recipe(task, schema=...)`` checks every ``key=value`` override against the schema before Hydra
composes the config, so a typo prints one line with a "did you mean" and the section's valid keys.
``user_errors()`` turns a user error raised in any process (a worker's arrives as ``RayTaskError``,
unwrapped by ``user_error_in``) into ``error: <message>`` on stderr and exit code 2; a bug keeps its
traceback. ``HYDRA_FULL_ERROR=1`` shows the traceback of a user error too.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from omegaconf import DictConfig, OmegaConf

from verl_balance.trainer.config.checks import ConfigError, did_you_mean

__all__ = ["USER_ERRORS", "check_overrides", "run_recipe", "user_error_in", "user_errors"]

USAGE_EXIT_CODE = 2


def _user_error_types() -> tuple[type[BaseException], ...]:
    """The exception classes that are the user's to fix (each message names the key, file or row)."""
    from verl_balance.algorithms.group_stats import AdvantageInputError
    from verl_balance.algorithms.kl import KLEstimatorError
    from verl_balance.algorithms.policy_loss import PolicyLossConfigError
    from verl_balance.algorithms.value_loss import ValueLossConfigError
    from verl_balance.balance.errors import BalanceInputError
    from verl_balance.data.io import DataError
    from verl_balance.data.synthetic import SyntheticConfigError
    from verl_balance.data.tokenizer import TokenizerError
    from verl_balance.engine.config import EngineConfigError
    from verl_balance.engine.lora import BaseMismatchError
    from verl_balance.loss import LossConfigError
    from verl_balance.models.config import ModelConfigError
    from verl_balance.models.preflight import PreflightError
    from verl_balance.rewards.score import RewardError
    from verl_balance.single_controller.resource_pool import UnplaceableResourcePoolError
    from verl_balance.trainer.checkpoint.resume_policy import ResumeConfigError
    from verl_balance.utils.atomic_io import UnsafePathError
    from verl_balance.utils.checksums import ChecksumMismatchError
    from verl_balance.utils.safe_load import UnsafeCheckpointError
    from verl_balance.utils.tracking import TrackingError
    from verl_balance.workers.actor_rollout import WarmStartError
    from verl_balance.workers.critic import CriticWarmStartError

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
        AdvantageInputError,
        KLEstimatorError,
        PolicyLossConfigError,
        ValueLossConfigError,
        LossConfigError,
        WarmStartError,
        CriticWarmStartError,
        UnsafePathError,
        ChecksumMismatchError,
        UnsafeCheckpointError,
    )


USER_ERRORS = _user_error_types()


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(USAGE_EXIT_CODE)


def user_error_in(err: BaseException) -> BaseException | None:
    """The user error (``USER_ERRORS``) ``err`` is or wraps, else None, following Ray's ``RayTaskError`` cause
    and ``__cause__`` / ``__context__``; the outermost user error wins."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        cause = getattr(current, "cause", None)
        if isinstance(cause, BaseException):  # Ray's RayTaskError (or its dual subclass)
            current = cause
            continue
        if isinstance(current, USER_ERRORS):
            return current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return None


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """A user error (``USER_ERRORS``), raised here or in a worker -> ``error: <message>`` on stderr and exit
    code 2 (traceback with HYDRA_FULL_ERROR=1); anything else propagates."""
    try:
        yield
    except Exception as err:
        found = user_error_in(err)
        if found is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        _fail(str(found))


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
    """(whether ``key`` exists, the deepest typed section on its path); keys under a free dict always exist."""
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
    """Exit 2 on an override of an undeclared key (with "did you mean") or ``+key=value`` for a declared one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    lines = [a for a in args if "=" in a and not a.startswith("-")]
    try:
        overrides = OverridesParser.create().parse_overrides(lines)
    except HydraException:
        return  # a syntax error: Hydra's own message says where
    root = _structured(schema)
    for override in overrides:
        key = override.key_or_group
        if override.is_hydra_override() or "/" in key or override.type == OverrideType.DEL:
            continue
        exists, section = _lookup(root, key)
        plain = override.input_line.lstrip("+")
        if exists and override.type == OverrideType.ADD:
            _fail(f"{key} is a key of the recipe already; '+' appends a new key: write {plain}")
        if exists and section is None and not override.is_sweep_override():
            _check_type(root, key, override)
        if not exists:
            hint = did_you_mean(key, _leaf_keys(root))
            where = key.rpartition(".")[0]
            valid = sorted(str(k) for k in section.keys()) if section is not None else []
            _fail(
                f"unknown config key {key!r} (from {override.input_line}){hint}; "
                f"valid keys of {where or 'the root'}: {valid}"
            )


_EXPECTED = {
    "IntegerNode": "an integer",
    "FloatNode": "a number",
    "BooleanNode": "true or false",
    "StringNode": "a string",
    "ListConfig": "a list, e.g. [a,b]",
    "DictConfig": "a mapping, e.g. {a: 1}",
}


_KINDS = {str: "the string", int: "the integer", float: "the number", bool: "the boolean", list: "the list"}
_KINDS[dict] = "the mapping"


def _schema_node(root: DictConfig, key: str):
    """The node of ``key`` when every section on its path is typed, else None."""
    node = root
    for part in key.split("."):
        if not isinstance(node, DictConfig) or node._is_none() or not _is_schema(node) or part not in node:
            return None
        node = node._get_node(part)
    return node


def _check_type(root: DictConfig, key: str, override) -> None:
    """Exit 2 (key, expected type, value) when ``override``'s value does not fit ``key``'s declared type."""
    from omegaconf import ValueNode
    from omegaconf.errors import OmegaConfBaseException

    node = _schema_node(root, key)
    value = override.value()
    if node is None or (isinstance(value, str) and "${" in value):
        return  # a free dict's key, or an interpolation resolved later
    try:
        if isinstance(node, ValueNode):
            node.validate_and_convert(value)
        else:  # a list or a section: merged into a copy, as Hydra merges it
            OmegaConf.update(root.copy(), key, value, merge=True)
    except OmegaConfBaseException:
        expected = _EXPECTED.get(type(node).__name__, "a value of its declared type")
        got = "null" if value is None else f"{_KINDS.get(type(value), type(value).__name__)} {value!r}"
        _fail(f"{key}={override.get_value_element_as_str()} is not valid: expected {expected}, got {got}")


@functools.lru_cache(maxsize=4)
def _structured(schema: type) -> DictConfig:
    """The schema's config, built once per schema (read-only here: a type check updates a copy)."""
    return OmegaConf.structured(schema)


def _has_config_flags(args: Sequence[str]) -> bool:
    flags = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd")
    return any(a.split("=")[0] in flags for a in args)


def _verl_command_line(recipe: str) -> str | None:
    """``sys.argv`` with verl's keys written for Hydra to add; returns the line naming removed config-group choices."""
    from verl_balance.trainer.config.verl_keys import command_line, startup_line

    try:
        args, groups = command_line(sys.argv[1:], recipe=recipe)
    except ConfigError as err:
        _fail(str(err))
    sys.argv[1:] = args
    return startup_line(groups, recipe=recipe)


def run_recipe(hydra_main: Callable[[], None], *, schema: type, recipe: str) -> None:
    """Let Hydra take verl's keys (``recipe``: 'grpo' or 'sft'), check the other overrides against
    ``schema``, then run the Hydra entry point with the console teed into the run log."""
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
