"""verl's ``ray_kwargs.ray_init``: keyword arguments of ``ray.init`` given by the user, checked
against ``ray.init``'s own signature and merged over the arguments ``cluster.start_ray`` chooses.

verl's rule: null values are left out, and ``runtime_env`` is merged key by key (the user's values win).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from verl_balance.trainer.config.checks import ConfigError

__all__ = ["RAY_INIT_KEY", "check_ray_init", "merge_ray_init"]

RAY_INIT_KEY = "ray_kwargs.ray_init"


def _without_nulls(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def _ray_init_parameters() -> tuple[set[str], bool]:
    """(ray.init's named keyword parameters, whether it also takes **kwargs: its private ``_*`` ones)."""
    import ray

    params = inspect.signature(ray.init).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def check_ray_init(ray_init: Mapping[str, Any] | None) -> dict[str, Any]:
    """The user's ``ray.init`` arguments without nulls; ConfigError naming every key ``ray.init`` does not take."""
    given = _without_nulls(dict(ray_init or {}))
    if not given:
        return given
    named, takes_private = _ray_init_parameters()
    unknown = sorted(k for k in given if k not in named and not (takes_private and k.startswith("_")))
    if unknown:
        raise ConfigError(
            f"{RAY_INIT_KEY}: ray.init takes no argument {', '.join(unknown)}; valid: {sorted(named)}; "
            "remove or rename it"
        )
    return given


def merge_ray_init(defaults: Mapping[str, Any], ray_init: Mapping[str, Any] | None) -> dict[str, Any]:
    """``defaults`` with the user's arguments over them; ``runtime_env`` and ``_system_config`` merged key by key."""
    user = check_ray_init(ray_init)
    out = {**defaults, **user}
    for key in ("runtime_env", "_system_config"):
        if key in defaults and key in user:
            out[key] = {**defaults[key], **user[key]}
    if "runtime_env" in defaults and "runtime_env" in user:
        env_vars = {**defaults["runtime_env"].get("env_vars", {}), **user["runtime_env"].get("env_vars", {})}
        out["runtime_env"]["env_vars"] = {k: str(v) for k, v in env_vars.items()}
    return out
