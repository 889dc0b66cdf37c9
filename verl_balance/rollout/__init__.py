"""Rollout: sample responses from the policy (built-in KV-cached decoder; vLLM/SGLang can slot in)."""

from verl_balance.rollout.base import RolloutEngine, RolloutInputError, RolloutOutput, SamplingParams
from verl_balance.rollout.batch import build_rollout_batch, build_rollout_tensors, group_uids
from verl_balance.rollout.naive import NaiveRollout, StateDictError
from verl_balance.rollout.sampling import sample_next_tokens

__all__ = [
    "NaiveRollout",
    "RolloutEngine",
    "RolloutInputError",
    "RolloutOutput",
    "SamplingParams",
    "StateDictError",
    "build_rollout_batch",
    "build_rollout_tensors",
    "group_uids",
    "sample_next_tokens",
]
