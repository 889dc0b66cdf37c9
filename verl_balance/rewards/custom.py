"""Load a user reward function from a python file (verl's ``custom_reward_function.path/name``)."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from functools import partial
from typing import Any

from .score import RewardError, RewardFn, compute_score


def load_reward_fn(
    path: str | None = None, name: str | None = None, *, reward_kwargs: Mapping[str, Any] | None = None
) -> RewardFn:
    """The built-in ``compute_score`` when ``path`` is None, else ``name`` (default "compute_score")
    from the python file at ``path``; ``reward_kwargs`` are bound as keyword arguments."""
    kwargs = dict(reward_kwargs or {})
    if path is None:
        if name is not None:
            raise RewardError(f"custom_reward_function.name={name!r} is set but custom_reward_function.path is not")
        return partial(compute_score, **kwargs) if kwargs else compute_score
    name = name or "compute_score"
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path) or not path.endswith(".py"):
        raise RewardError(f"custom_reward_function.path={path!r} is not an existing .py file")
    module_name = "verl_balance_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    # Registered only while executing (dataclasses and the like look their module up); afterwards
    # the module is unknown to sys.modules, so cloudpickle ships its functions to Ray workers by value.
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as err:  # sys.exit() at import must not end the run as a success
        raise RewardError(f"custom_reward_function.path={path!r} failed to import: {err!r}") from err
    finally:
        del sys.modules[module_name]
    fn = getattr(module, name, None)
    if not callable(fn):
        available = sorted(n for n, obj in vars(module).items() if inspect.isfunction(obj) and not n.startswith("_"))
        raise RewardError(
            f"custom_reward_function.name={name!r} is not a function in {path}; functions there: {available}"
        )
    return partial(fn, **kwargs) if kwargs else fn
