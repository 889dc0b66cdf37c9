"""build_rollout: the rollout backend for a model config (the one place a new backend plugs in)."""

from __future__ import annotations

from verl_balance.rollout.base import RolloutEngine, RolloutInputError

# "kv_cache": the built-in decoder's own math; "hf": the HF model with its DynamicCache. A vLLM or
# SGLang backend would be a third entry implementing RolloutEngine (see docs/models.md).
ROLLOUT_BACKENDS = ("auto", "kv_cache", "hf")


def build_rollout(model_config, *, backend: str = "auto", **kwargs) -> RolloutEngine:
    """A RolloutEngine for ``model_config``: "auto" picks KVCacheRollout for the built-in
    ``ModelConfig`` and HFRollout for an ``HFModelConfig``. ``kwargs`` go to the backend
    (state_dict, pad_token_id, max_batch_size, device, dtype)."""
    from verl_balance.models.config import ModelConfig

    if backend not in ROLLOUT_BACKENDS:
        raise RolloutInputError(f"rollout backend {backend!r}; valid: {ROLLOUT_BACKENDS}")
    if backend == "auto":
        backend = "kv_cache" if isinstance(model_config, ModelConfig) else "hf"
    if backend == "kv_cache":
        from verl_balance.rollout.kv_cache_generator import KVCacheRollout

        return KVCacheRollout(model_config=model_config, **kwargs)
    from verl_balance.rollout.hf_generator import HFRollout

    return HFRollout(model_config=model_config, **kwargs)
