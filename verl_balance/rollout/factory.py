"""build_rollout: the rollout backend for a model config (the one place a new backend plugs in)."""

from __future__ import annotations

from verl_balance.rollout.base import RolloutEngine, RolloutInputError

# "kv_cache": the built-in decoder's own math; "hf": the HF model with its DynamicCache; "vllm": an
# in-process vLLM engine (HF models; optional dependency, imported only when built). An SGLang backend
# would be another entry implementing RolloutEngine (see docs/models.md).
ROLLOUT_BACKENDS = ("auto", "kv_cache", "hf", "vllm")
HF_BACKENDS = ("hf", "vllm")


def resolve_backend(backend: str, *, hf_model: bool) -> str:
    """The backend ``backend`` names for a built-in (``hf_model=False``) or HF model ("auto": kv_cache or
    hf); RolloutInputError for an unknown name or a backend that cannot run that model."""
    if backend not in ROLLOUT_BACKENDS:
        raise RolloutInputError(f"rollout backend {backend!r} is not valid; expected one of {list(ROLLOUT_BACKENDS)}")
    if backend == "auto":
        return "hf" if hf_model else "kv_cache"
    if (backend in HF_BACKENDS) != hf_model:
        model = "an HF model directory" if hf_model else "the built-in model"
        valid = ["auto", *HF_BACKENDS] if hf_model else ["auto", "kv_cache"]
        raise RolloutInputError(f"rollout backend {backend!r} cannot run {model}; expected one of {valid}")
    return backend


def build_rollout(model_config, *, backend: str = "auto", **kwargs) -> RolloutEngine:
    """A RolloutEngine for ``model_config``: KVCacheRollout ("kv_cache") for the built-in ``ModelConfig``,
    HFRollout ("hf") or VLLMRollout ("vllm") for an ``HFModelConfig``; ``kwargs`` go to the backend."""
    from verl_balance.models.config import ModelConfig

    backend = resolve_backend(backend, hf_model=not isinstance(model_config, ModelConfig))
    vllm_config = kwargs.pop("vllm_config", None)
    if backend == "vllm":
        from verl_balance.rollout.vllm_rollout import VLLMRollout

        return VLLMRollout(model_config=model_config, config=vllm_config, **kwargs)
    if backend == "kv_cache":
        from verl_balance.rollout.kv_cache_generator import KVCacheRollout

        return KVCacheRollout(model_config=model_config, **kwargs)
    from verl_balance.rollout.hf_generator import HFRollout

    return HFRollout(model_config=model_config, **kwargs)
