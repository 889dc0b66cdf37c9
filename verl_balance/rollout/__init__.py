"""Rollout: sample responses from the policy. ``RolloutEngine`` is the interface (a vLLM/SGLang
backend would implement it); ``build_rollout`` picks the built-in KV-cached backend for the model."""

from verl_balance.rollout.base import RolloutEngine, RolloutInputError, RolloutOutput, SamplingParams
from verl_balance.rollout.batch import build_rollout_batch, build_rollout_tensors, group_uids
from verl_balance.rollout.factory import ROLLOUT_BACKENDS, build_rollout
from verl_balance.rollout.kv_cache_generator import KVCacheRollout, StateDictError
from verl_balance.rollout.sampling import sample_next_tokens

__all__ = [
    "ROLLOUT_BACKENDS",
    "KVCacheRollout",
    "RolloutEngine",
    "RolloutInputError",
    "RolloutOutput",
    "SamplingParams",
    "StateDictError",
    "build_rollout",
    "build_rollout_batch",
    "build_rollout_tensors",
    "group_uids",
    "sample_next_tokens",
]
