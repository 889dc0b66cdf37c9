"""Our reward-function spelling inside verl's own trainers.

Our recipes spell the reward function ``custom_reward_function.{path,name}`` at the top level (verl's
older spelling); verl 0.9.1 reads ``reward.custom_reward_function`` only
(``verl.trainer.ppo.reward.get_custom_reward_fn``), so a top-level key passed to verl's ``main_ppo``
was silently ignored and verl failed after the first rollout with no scorer for the data source.

``patch_verl`` (and so ``autopatch``) wraps that loader: when verl's own ``reward.custom_reward_function.path``
is unset and the top-level ``custom_reward_function.path`` is set, verl's loader sees ours (with a null
``name`` read as ``compute_score``, our default and verl's). Feature-detected: a verl whose config has no
top-level key, or whose loader takes another argument, gets verl's loader unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["DEFAULT_REWARD_FN_NAME", "reward_loader_with_our_spelling", "with_our_reward_spelling"]

DEFAULT_REWARD_FN_NAME = "compute_score"
"""The function name when ``custom_reward_function.name`` is null (ours and verl's default)."""


def _get(node: Any, key: str) -> Any:
    getter = getattr(node, "get", None)
    return getter(key) if callable(getter) else None


def with_our_reward_spelling(config: Any) -> Any:
    """``config`` itself when verl's ``reward.custom_reward_function.path`` is set or ours is not;
    otherwise a copy whose ``reward.custom_reward_function`` is our top-level one. ValueError when
    both paths are set to different files (which one would run is a guess)."""
    ours = _get(config, "custom_reward_function")
    reward = _get(config, "reward")
    if not _get(ours, "path") or reward is None:
        return config
    theirs = _get(reward, "custom_reward_function")
    if _get(theirs, "path"):
        if _get(theirs, "path") != _get(ours, "path"):
            raise ValueError(
                f"custom_reward_function.path={_get(ours, 'path')!r} and reward.custom_reward_function.path="
                f"{_get(theirs, 'path')!r} name two reward functions; set one of them"
            )
        return config
    from omegaconf import OmegaConf, open_dict

    merged = OmegaConf.create(OmegaConf.to_container(config, resolve=False))
    with open_dict(merged):
        node = OmegaConf.to_container(ours, resolve=True)
        node["name"] = node.get("name") or DEFAULT_REWARD_FN_NAME
        merged.reward.custom_reward_function = node
    return merged


def reward_loader_with_our_spelling(original):
    """verl's ``get_custom_reward_fn(config)`` that reads our top-level spelling when verl's is unset."""

    @functools.wraps(original)
    def get_custom_reward_fn(config, *args, **kwargs):
        return original(with_our_reward_spelling(config), *args, **kwargs)

    get_custom_reward_fn.__wrapped_original__ = original
    return get_custom_reward_fn
