"""KVCacheRollout: batched, KV-cached, inference-only decoding of the built-in Llama-style model.

It reads the training model's state dict directly (``models/llama.py``'s names and math), so a
colocated actor hands over ``full_state_dict()`` without conversion; the sampling loop is
``rollout/decoding.CachedDecoder``.

Invariants:
- Left-padded static cache: the k-th generated token of every row goes to slot P + k (P: longest
  prompt). Pad slots are never attended to; position ids count real tokens from 0. Hence every real
  token's logits equal a single-sequence, no-cache forward.
- Finished sequences are removed from the batch and the cache at once.
- Compute runs on the device and in the dtype of the state dict tensors (no_grad).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from verl_balance.models.config import ModelConfig
from verl_balance.models.llama import rms_norm, rotary_cos_sin, rotate_half
from verl_balance.rollout.base import RolloutInputError
from verl_balance.rollout.decoding import CachedDecoder, left_pad


class StateDictError(ValueError):
    """The state dict does not match the model config (missing key or wrong shape)."""


def expected_state_dict_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every weight of the built-in model (``models/llama.py`` names)."""
    h, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    shapes = {"embed_tokens.weight": (config.vocab_size, h), "norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_norm.weight": (h,),
                p + "attn.q_proj.weight": (config.num_heads * hd, h),
                p + "attn.k_proj.weight": (config.num_kv_heads * hd, h),
                p + "attn.v_proj.weight": (config.num_kv_heads * hd, h),
                p + "attn.o_proj.weight": (h, config.num_heads * hd),
                p + "post_attn_norm.weight": (h,),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            }
        )
    return shapes


class _KVCache:
    """Per-layer key/value buffers (B, num_kv_heads, capacity, head_dim) shared by B left-padded rows."""

    def __init__(self, *, config: ModelConfig, batch: int, capacity: int, dtype: torch.dtype, device: torch.device):
        shape = (batch, config.num_kv_heads, capacity, config.head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.slot_is_token = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.int64, device=device)
        self.filled = 0

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` (indices into the current batch)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.slot_is_token = self.slot_is_token.index_select(0, rows)
        self.next_position = self.next_position.index_select(0, rows)


class KVCacheRollout(CachedDecoder):
    """Built-in rollout backend: the built-in decoder's math with a left-padded KV cache."""

    def __init__(
        self,
        *,
        model_config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        pad_token_id: int = 0,
        max_batch_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        """``model_config``: the built-in ``ModelConfig``. ``max_batch_size`` bounds the sequences decoded
        together (None: all); ``device``/``dtype`` None keep the state dict's (referenced, not copied)."""
        if not isinstance(model_config, ModelConfig):
            raise StateDictError(
                f"KVCacheRollout needs the built-in ModelConfig, got {type(model_config).__name__} "
                "(use verl_balance.rollout.build_rollout to pick the backend)"
            )
        if max_batch_size is not None and max_batch_size < 1:
            raise RolloutInputError(f"max_batch_size={max_batch_size} must be >= 1 or None")
        self.config = model_config
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        self._target_device = None if device is None else torch.device(device)
        self._target_dtype = dtype
        self._weights: dict[str, torch.Tensor] | None = None
        if state_dict is not None:
            self.update_weights(state_dict)

    # ------------------------------------------------------------------ weights
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Use the given weights (moved to ``device``/``dtype`` if set, else referenced without a
        copy); checks every expected name and shape."""
        expected = expected_state_dict_shapes(self.config)
        missing = [k for k in expected if k not in state_dict]
        if missing:
            raise StateDictError(f"state dict lacks {missing[:5]} (and {max(0, len(missing) - 5)} more)")
        for name, shape in expected.items():
            if tuple(state_dict[name].shape) != shape:
                raise StateDictError(f"{name} has shape {tuple(state_dict[name].shape)}, expected {shape}")
        weights = {k: state_dict[k].detach().to(device=self._target_device, dtype=self._target_dtype) for k in expected}
        devices = {w.device for w in weights.values()}
        dtypes = {w.dtype for w in weights.values()}
        if len(devices) != 1 or len(dtypes) != 1:
            raise StateDictError(f"all weights must share one device and dtype, got {devices} and {dtypes}")
        self._weights = weights

    @property
    def device(self) -> torch.device:
        """Device the decoder runs on (that of its weights)."""
        self._require_weights()
        return self._weights["embed_tokens.weight"].device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype (that of its weights; RMSNorm still normalizes in fp32)."""
        self._require_weights()
        return self._weights["embed_tokens.weight"].dtype

    def _require_weights(self) -> None:
        if self._weights is None:
            raise RuntimeError("the rollout has no weights yet; call update_weights(state_dict) first")

    # ------------------------------------------------------------------ forward
    def _forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        is_token: torch.Tensor,
        cache: _KVCache,
        *,
        all_logits: bool,
    ) -> torch.Tensor:
        """Run T new tokens per row (tokens/positions/is_token: (B, T)) into ``cache``; logits (B, T, V),
        or (B, V) of the last position unless ``all_logits``."""
        w, c = self._weights, self.config
        batch, num_new = tokens.shape
        start, end = cache.filled, cache.filled + num_new
        cache.slot_is_token[:, start:end] = is_token
        cache.filled = end

        # Key slot j is visible to the query in slot q iff j <= q and j holds a real token; the
        # diagonal is always visible so pad queries (whose outputs are discarded) are not empty.
        query_slot = torch.arange(start, end, device=tokens.device)[:, None]
        key_slot = torch.arange(end, device=tokens.device)[None, :]
        visible = (key_slot <= query_slot)[None] & cache.slot_is_token[:, None, :end]
        visible = (visible | (key_slot == query_slot)[None])[:, None]  # (B, 1, T, end)

        cos, sin = rotary_cos_sin(positions, head_dim=c.head_dim, theta=c.rope_theta, dtype=self.dtype)
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hd): broadcast over heads

        hidden = F.embedding(tokens, w["embed_tokens.weight"])
        for i in range(c.num_layers):
            p = f"layers.{i}."
            x = rms_norm(hidden, w[p + "input_norm.weight"], c.rms_norm_eps)
            q = F.linear(x, w[p + "attn.q_proj.weight"]).view(batch, num_new, c.num_heads, c.head_dim)
            k = F.linear(x, w[p + "attn.k_proj.weight"]).view(batch, num_new, c.num_kv_heads, c.head_dim)
            v = F.linear(x, w[p + "attn.v_proj.weight"]).view(batch, num_new, c.num_kv_heads, c.head_dim)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            cache.keys[i][:, :, start:end] = k
            cache.values[i][:, :, start:end] = v
            attn = F.scaled_dot_product_attention(
                q,
                cache.keys[i][:, :, :end],
                cache.values[i][:, :, :end],
                attn_mask=visible,
                scale=c.head_dim**-0.5,
                enable_gqa=c.num_heads != c.num_kv_heads,
            )
            attn = attn.transpose(1, 2).reshape(batch, num_new, c.num_heads * c.head_dim)
            hidden = hidden + F.linear(attn, w[p + "attn.o_proj.weight"])
            x = rms_norm(hidden, w[p + "post_attn_norm.weight"], c.rms_norm_eps)
            gate = F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"]))
            hidden = hidden + F.linear(gate * F.linear(x, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])

        hidden = rms_norm(hidden if all_logits else hidden[:, -1], w["norm.weight"], c.rms_norm_eps)
        head = w["embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
        return F.linear(hidden, head)

    def _prefill(self, prompts: list[list[int]], *, capacity: int, all_logits: bool) -> tuple[_KVCache, torch.Tensor]:
        tokens, is_token, positions, lengths = left_pad(prompts, pad_token_id=self.pad_token_id, device=self.device)
        cache = _KVCache(
            config=self.config, batch=len(prompts), capacity=capacity, dtype=self.dtype, device=self.device
        )
        cache.next_position = lengths.clone()
        logits = self._forward(tokens, positions, is_token, cache, all_logits=all_logits)
        return cache, logits

    def _decode_step(self, tokens: torch.Tensor, cache: _KVCache) -> torch.Tensor:
        positions = cache.next_position[:, None]
        cache.next_position = cache.next_position + 1
        is_token = torch.ones_like(tokens, dtype=torch.bool)[:, None]
        return self._forward(tokens[:, None], positions, is_token, cache, all_logits=False)
