"""Workload models: the predicted cost of processing one sequence, as a function of its length.

Invariants:
- ``cost(lengths)`` returns a float64 array of the same shape, non-negative and non-decreasing
  in length; a packed micro-batch costs the sum of its sequences' costs.
- ``TokenWorkload`` is exactly the length; ``FlopsWorkload`` is forward FLOPs of a Llama-style
  (optionally MoE) decoder; ``CalibratedWorkload`` is fitted seconds.
- A fixed cost per micro-batch is not part of ``cost`` and is added by the planner; only
  ``CalibratedWorkload`` has one (``micro_batch_overhead`` returns 0 otherwise).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from verl_balance.balance.errors import BalanceConfigError


class Workload(Protocol):
    """Anything with ``cost(lengths) -> float64 array``."""

    def cost(self, lengths: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class TokenWorkload:
    """Cost = number of tokens (what a token cap and memory see)."""

    name: str = "tokens"

    def cost(self, lengths: np.ndarray) -> np.ndarray:
        """Float64 cost per sequence, equal to its length."""
        return np.asarray(lengths, dtype=np.float64)


@dataclass(frozen=True)
class FlopsWorkload:
    """Forward FLOPs of a Llama-style decoder per sequence, from the model's dimensions."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int | None = None
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Routed experts each token passes through (top-k)."""
    moe_intermediate_size: int | None = None
    """MLP width of one routed expert (None: intermediate_size, as in Mixtral)."""
    shared_expert_intermediate_size: int = 0
    """Total MLP width of the always-active shared experts (Qwen2-MoE, DeepSeek)."""
    num_moe_layers: int | None = None
    """Layers whose MLP is the MoE block (None: all layers of an MoE model)."""
    name: str = "flops"

    def __post_init__(self) -> None:
        for key in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size"):
            if int(getattr(self, key)) < 1:
                raise BalanceConfigError(f"FlopsWorkload.{key} must be >= 1, got {getattr(self, key)!r}")
        if self.num_heads % self.num_kv_heads:
            raise BalanceConfigError(
                f"FlopsWorkload.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise BalanceConfigError(
                f"FlopsWorkload.num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
                f"({self.num_experts})"
            )
        if self.num_moe_layers is not None and not 0 <= self.num_moe_layers <= self.num_layers:
            raise BalanceConfigError(
                f"FlopsWorkload.num_moe_layers ({self.num_moe_layers}) must be in 0..num_layers ({self.num_layers})"
            )

    @property
    def _head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def _moe_layers(self) -> int:
        if not self.num_experts:
            return 0
        return self.num_layers if self.num_moe_layers is None else self.num_moe_layers

    @property
    def linear_flops_per_token(self) -> float:
        """2 * (multiply-adds of every weight matrix a token passes through; MoE: active ones)."""
        h, f, d = self.hidden_size, self.intermediate_size, self._head_dim
        q_and_o = 2 * h * self.num_heads * d
        k_and_v = 2 * h * self.num_kv_heads * d
        dense_mlp = 3 * h * f
        expert_width = self.moe_intermediate_size or f
        moe_mlp = (
            h * self.num_experts  # router
            + 3 * h * expert_width * self.num_experts_per_tok
            + 3 * h * self.shared_expert_intermediate_size
        )
        moe_layers = self._moe_layers
        mlp = (self.num_layers - moe_layers) * dense_mlp + moe_layers * moe_mlp
        return 2.0 * (self.num_layers * (q_and_o + k_and_v) + mlp + h * self.vocab_size)

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs per (query, key) pair in the causal triangle: QK^T and AV, all heads, all layers."""
        return 2.0 * 2.0 * self.num_heads * self._head_dim * self.num_layers

    def cost(self, lengths: np.ndarray) -> np.ndarray:
        """Float64 forward FLOPs per sequence: linear * L + attention * L (L + 1) / 2."""
        length = np.asarray(lengths, dtype=np.float64)
        return self.linear_flops_per_token * length + self.attention_flops_per_pair * length * (length + 1.0) / 2.0

    @classmethod
    def from_model_config(cls, cfg) -> FlopsWorkload:
        """From a model config object or dict (ours, HF's, or a multimodal config's ``text_config``)."""
        get = _getter(cfg)
        text_config = get("text_config")
        if text_config is not None:
            cfg, get = text_config, _getter(text_config)
        values = {}
        for key, aliases in _DIMENSION_ALIASES.items():
            found = next((get(a) for a in (key, *aliases) if get(a) is not None), None)
            if found is not None:
                values[key] = int(found)
        if "num_kv_heads" not in values and "num_heads" in values:
            values["num_kv_heads"] = values["num_heads"]  # HF: num_key_value_heads absent means MHA
        missing = [k for k in _DIMENSION_ALIASES if k not in values]
        if missing:
            raise BalanceConfigError(
                f"model config {type(cfg).__name__} lacks {missing}; FlopsWorkload needs {list(_DIMENSION_ALIASES)} "
                "(or their Hugging Face names); use balance.workload=tokens otherwise"
            )
        head_dim = mla_query_head_dim(cfg) or get("head_dim")
        return cls(**values, head_dim=None if head_dim is None else int(head_dim), **moe_dimensions(cfg))


# Our dimension names -> the Hugging Face config names of the same quantity.
_DIMENSION_ALIASES = {
    "num_layers": ("num_hidden_layers",),
    "hidden_size": (),
    "intermediate_size": (),
    "num_heads": ("num_attention_heads",),
    "num_kv_heads": ("num_key_value_heads",),
    "vocab_size": (),
}


def _getter(cfg):
    """``get(key)`` -> the value or None, for a dict or any object with attributes."""
    if isinstance(cfg, dict):
        return cfg.get
    return lambda key: getattr(cfg, key, None)


def _first(get, *keys):
    return next((get(k) for k in keys if get(k) is not None), None)


def mla_query_head_dim(cfg) -> int | None:
    """DeepSeek MLA's query/key head ``qk_nope_head_dim + qk_rope_head_dim``, else None."""
    get = _getter(cfg)
    if get("qk_nope_head_dim") is None or get("qk_rope_head_dim") is None:
        return None
    return int(get("qk_nope_head_dim")) + int(get("qk_rope_head_dim"))


def moe_dimensions(cfg) -> dict:
    """The MoE fields of ``FlopsWorkload`` from a config (ours or HF's spellings); {} for a dense model."""
    get = _getter(cfg)
    experts = _first(get, "num_experts", "num_local_experts", "n_routed_experts")
    if not experts:
        return {}
    num_layers = int(_first(get, "num_layers", "num_hidden_layers"))
    moe_width = get("moe_intermediate_size")
    shared = get("shared_expert_intermediate_size")
    if shared is None and get("n_shared_experts"):
        shared = int(get("n_shared_experts")) * int(moe_width)
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(get("num_experts_per_tok")),
        moe_intermediate_size=None if moe_width is None else int(moe_width),
        shared_expert_intermediate_size=int(shared or 0),
        num_moe_layers=_count_moe_layers(get, num_layers),
    )


def _count_moe_layers(get, num_layers: int) -> int:
    """How many decoder layers route through experts, by each family's layer rule."""
    if get("num_moe_layers") is not None:
        return int(get("num_moe_layers"))
    if get("first_k_dense_replace") is not None:  # DeepSeek: layer i >= k with i % freq == 0
        first, freq = int(get("first_k_dense_replace")), int(get("moe_layer_freq") or 1)
        return sum(1 for i in range(num_layers) if i >= first and i % freq == 0)
    if get("decoder_sparse_step") is not None or get("mlp_only_layers") is not None:  # Qwen2/3-MoE
        step, dense = int(get("decoder_sparse_step") or 1), set(get("mlp_only_layers") or ())
        return sum(1 for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return num_layers


def from_model_config(cfg) -> FlopsWorkload:
    """Shorthand for ``FlopsWorkload.from_model_config(cfg)``."""
    return FlopsWorkload.from_model_config(cfg)


def resolve_workload(workload) -> Workload:
    """None or "tokens" -> TokenWorkload; an object with ``cost`` is used as is."""
    if workload is None or (isinstance(workload, str) and workload == "tokens"):
        return TokenWorkload()
    if isinstance(workload, str):
        raise BalanceConfigError(
            f"workload={workload!r} is unknown; valid: None, 'tokens', or a FlopsWorkload "
            "(FlopsWorkload.from_model_config(model_config)) or any object with cost(lengths)"
        )
    if not callable(getattr(workload, "cost", None)):
        raise BalanceConfigError(f"workload {workload!r} has no cost(lengths) method")
    return workload


# Keys of a calibration file (``python -m verl_balance.calibrate``) that the workload reads.
CALIBRATION_COEFFICIENTS = ("micro_batch", "sequence", "token", "pair")
COEFFICIENT_RANGE_S = (1e-30, 1e6)
"""Seconds a non-zero coefficient may hold: 1e-30 to 11 days; outside it sums overflow or vanish."""


@dataclass(frozen=True)
class CalibratedWorkload:
    """Measured seconds of forward + backward on one rank (``python -m verl_balance.calibrate``);
    ``micro_batch_cost`` is paid by every micro-batch on every rank, empty ones included."""

    micro_batch: float
    sequence: float
    token: float
    pair: float
    fingerprint: dict = field(default_factory=dict, compare=False, hash=False)
    source: str = field(default="", compare=False)
    name: str = "calibrated"

    def __post_init__(self) -> None:
        for key in CALIBRATION_COEFFICIENTS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise BalanceConfigError(
                    f"calibrated workload coefficient {key}={value!r}{_from(self.source)} is invalid; "
                    "valid: a finite number >= 0 (seconds)"
                )
            low, high = COEFFICIENT_RANGE_S
            if value and not low <= value <= high:
                raise BalanceConfigError(
                    f"calibrated workload coefficient {key}={value!r}{_from(self.source)} is out of range; "
                    f"valid: 0 or {low:g} to {high:g} seconds (recalibrate: python -m verl_balance.calibrate)"
                )
        if self.token <= 0 and self.pair <= 0 and self.sequence <= 0:
            raise BalanceConfigError(
                f"calibrated workload{_from(self.source)} has sequence = token = pair = 0: every plan would "
                "cost the same; recalibrate (python -m verl_balance.calibrate)"
            )

    @property
    def micro_batch_cost(self) -> float:
        """Fixed cost of one micro-batch slot (seconds), paid whatever it holds."""
        return float(self.micro_batch)

    def cost(self, lengths: np.ndarray) -> np.ndarray:
        """Float64 per-sequence cost: sequence + token * L + pair * L (L + 1) / 2."""
        length = np.asarray(lengths, dtype=np.float64)
        return self.sequence + self.token * length + self.pair * length * (length + 1.0) / 2.0

    def micro_batch_seconds(self, lengths) -> float:
        """Predicted seconds of one micro-batch holding sequences of these lengths."""
        return self.micro_batch_cost + float(self.cost(np.asarray(lengths)).sum())

    def describe(self) -> str:
        """One line for the start-up log."""
        fp = self.fingerprint
        what = ", ".join(f"{k}={fp[k]}" for k in ("model", "dtype", "attn_impl", "world_size", "host") if k in fp)
        return (
            f"calibrated workload{_from(self.source)}: {self.micro_batch * 1e3:.3f} ms per micro-batch + "
            f"{self.sequence * 1e6:.2f} us per sequence + {self.token * 1e6:.3f} us per token + "
            f"{self.pair * 1e9:.3f} ns per attention pair" + (f" ({what})" if what else "")
        )

    def to_dict(self) -> dict:
        """The coefficients (seconds) and fingerprint, as in the calibration file."""
        return {
            "coefficients": {k: float(getattr(self, k)) for k in CALIBRATION_COEFFICIENTS},
            "fingerprint": dict(self.fingerprint),
        }

    @classmethod
    def from_dict(cls, data: dict, *, source: str = "") -> CalibratedWorkload:
        """From a calibration file's ``{"coefficients": {...}, "fingerprint": {...}}`` (missing ``sequence``: 0)."""
        coefficients = data.get("coefficients") if isinstance(data, dict) else None
        if not isinstance(coefficients, dict):
            raise BalanceConfigError(
                f"calibration{_from(source)} has no 'coefficients' mapping; valid: the JSON written by "
                "python -m verl_balance.calibrate"
            )
        missing = [k for k in ("micro_batch", "token", "pair") if k not in coefficients]
        unknown = sorted(set(coefficients) - set(CALIBRATION_COEFFICIENTS))
        if missing or unknown:
            raise BalanceConfigError(
                f"calibration{_from(source)} coefficients: missing {missing}, unknown {unknown}; "
                f"valid keys: {list(CALIBRATION_COEFFICIENTS)} (sequence is optional)"
            )
        values = {k: coefficients.get(k, 0.0) for k in CALIBRATION_COEFFICIENTS}
        return cls(**values, fingerprint=dict(data.get("fingerprint") or {}), source=source)

    @classmethod
    def from_file(cls, path: str) -> CalibratedWorkload:
        """Read a calibration JSON (``python -m verl_balance.calibrate --out PATH``)."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError as err:
            raise BalanceConfigError(
                f"calibration file {path!r} does not exist; write one with python -m verl_balance.calibrate "
                f"--out {path}"
            ) from err
        except (OSError, ValueError) as err:
            raise BalanceConfigError(f"calibration file {path!r} cannot be read as JSON ({err})") from err
        return cls.from_dict(data, source=str(path))


def _from(source: str) -> str:
    return f" (from {source})" if source else ""


def micro_batch_overhead(workload) -> float:
    """The fixed cost per micro-batch slot of a workload (0 for the token and FLOPs models)."""
    return float(getattr(workload, "micro_batch_cost", 0.0) or 0.0)
