"""FLOPs workload models from the model configs verl holds (Hugging Face dimension names)."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from verl_balance.balance import BalanceInputError, FlopsWorkload
from verl_balance.balance.workload import moe_dimensions

logger = logging.getLogger(__name__)

_HF_DIMENSION_NAMES = {
    "num_layers": ("num_hidden_layers", "num_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "n_inner"),
    "num_heads": ("num_attention_heads", "num_heads", "n_head"),
    "num_kv_heads": ("num_key_value_heads", "num_kv_heads", "num_attention_heads", "num_heads", "n_head"),
    "vocab_size": ("vocab_size",),
}


def workload_from_hf_config(config: Any) -> FlopsWorkload:
    """FLOPs workload from a model config with Hugging Face (or ``ModelConfig``) dimension names.

    Accepts a ``transformers.PretrainedConfig``, our ``ModelConfig``, a dict or any object with the
    attributes; multimodal configs are read through ``text_config`` when they have one.
    """
    getter = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    text_config = getter("text_config", None)
    if text_config is not None and getter("hidden_size", None) is None:
        return workload_from_hf_config(text_config)
    dims = {}
    for ours, names in _HF_DIMENSION_NAMES.items():
        value = next((getter(n) for n in names if getter(n, None) is not None), None)
        if value is None:
            raise BalanceInputError(
                f"model config {type(config).__name__} has none of {list(names)}; a FLOPs workload needs "
                f"{sorted(_HF_DIMENSION_NAMES)} (pass workload='tokens' to balance by tokens instead)"
            )
        dims[ours] = int(value)
    head_dim = getter("head_dim", None)
    return FlopsWorkload(**dims, head_dim=int(head_dim) if head_dim else None, **moe_dimensions(config))


def workload_from_model_path(path: str, *, trust_remote_code: bool = False) -> Any:
    """FLOPs workload of the model at ``path`` (its local HF config), else ``"tokens"`` with a warning.

    A missing or unreadable config must not stop training: balancing by tokens is still correct,
    only less even."""
    try:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, local_files_only=True)
        return workload_from_hf_config(hf_config)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        logger.warning(
            "verl_balance: could not build a FLOPs workload from model path %r (%s); balancing by token count instead",
            path,
            exc,
        )
        return "tokens"


def workload_of_actor(trainer) -> Any:
    """FLOPs workload of a verl PPO trainer's actor model (``actor_rollout_ref.model.path``)."""
    model_cfg = trainer.config.actor_rollout_ref.model
    return workload_from_model_path(model_cfg.path, trust_remote_code=bool(model_cfg.get("trust_remote_code", False)))


@dataclass(frozen=True)
class VerlWorkload:
    """verl's own workload model (``calculate_workload``): ``24576 * L + L**2`` per sample of length L.

    It is what verl 0.9.1 weighs by in both its DP partition and its micro-batch packer (a FLOPs
    proxy calibrated for a 7B model); our drop-ins use it by default so both stages weigh alike."""

    linear_per_token: float = 24576.0

    def cost(self, lengths: np.ndarray) -> np.ndarray:
        """Relative cost of each sample."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.linear_per_token * lengths + lengths * lengths


WORKLOAD_ENV = "VERL_BALANCE_WORKLOAD"


def workload_from_env() -> Any:
    """The process-wide default workload, the same in every process that reads the same environment.

    ``VERL_BALANCE_WORKLOAD`` unset or ``"verl"``: ``VerlWorkload()`` (verl's own model);
    ``"tokens"``: token count; anything else: a local Hugging Face model directory whose config
    gives a ``FlopsWorkload`` (falls back to tokens with a warning when it cannot be read)."""
    return _workload_for(os.environ.get(WORKLOAD_ENV, "").strip())


@functools.lru_cache(maxsize=8)
def _workload_for(value: str) -> Any:
    if value in ("", "verl"):
        return VerlWorkload()
    if value == "tokens":
        return "tokens"
    return workload_from_model_path(value)
