"""Deprecated module path: the built-in rollout lives in ``rollout/kv_cache_generator.py``."""

from verl_balance.rollout.kv_cache_generator import (  # noqa: F401
    KVCacheRollout,
    NaiveRollout,
    StateDictError,
    expected_state_dict_shapes,
)
