"""HFRollout: KV-cached decoding of Hugging Face models (``models.hf.SUPPORTED_MODEL_TYPES``).

It runs the HF model itself (HF's ``DynamicCache``) with the training adapter's weights (exact HF
names); the sampling loop is ``rollout/decoding.CachedDecoder``.

Invariants:
- Left padding with a 2-D attention mask and position ids counting real tokens from 0, so every
  real token's logits equal an unpadded, uncached forward of its sequence.
- Finished rows are dropped from the batch and from the cache at once.
- The model is built from its own copy of the HF config (never shared with the training model).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from verl_balance.models.attention import use_grouped_sdpa
from verl_balance.rollout.base import RolloutInputError
from verl_balance.rollout.decoding import CachedDecoder, left_pad
from verl_balance.rollout.kv_cache_generator import StateDictError


class _HFDecodeCache:
    """HF's DynamicCache plus the 2-D attention mask and next position of each row."""

    def __init__(self, cache, attention_mask: torch.Tensor, next_position: torch.Tensor):
        self.cache, self.attention_mask, self.next_position = cache, attention_mask, next_position

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` (indices into the current batch)."""
        self.cache.batch_select_indices(rows)
        self.attention_mask = self.attention_mask.index_select(0, rows)
        self.next_position = self.next_position.index_select(0, rows)


class HFRollout(CachedDecoder):
    """Rollout backend for ``HFModelConfig`` models: HF forward + DynamicCache, our sampling loop."""

    def __init__(
        self,
        *,
        model_config,
        state_dict: Mapping[str, torch.Tensor] | None = None,
        pad_token_id: int = 0,
        max_batch_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        """``model_config``: an ``HFModelConfig``. ``state_dict`` (HF names) replaces the weights, else the
        directory's are used when ``init == "pretrained"``. ``device``/``dtype`` default to CPU, fp32."""
        from verl_balance.models.hf import HFModelConfig, build_hf_model

        if not isinstance(model_config, HFModelConfig):
            raise StateDictError(f"HFRollout needs an HFModelConfig, got {type(model_config).__name__}")
        if max_batch_size is not None and max_batch_size < 1:
            raise RolloutInputError(f"max_batch_size={max_batch_size} must be >= 1 or None")
        self.config = model_config
        self.pad_token_id = int(pad_token_id)
        self.max_batch_size = max_batch_size
        with torch.random.fork_rng(devices=[]):  # random init must not move the caller's RNG
            self.model = build_hf_model(
                replace(model_config, init="random") if state_dict is not None else model_config,
                attn_implementation="sdpa",
            )
        self.model.to(device=device, dtype=dtype).eval()
        self._device, self._dtype = self.model.lm_head.weight.device, self.model.lm_head.weight.dtype
        if self._device.type == "cpu":
            use_grouped_sdpa(self.model)
        self._has_weights = state_dict is not None or model_config.init == "pretrained"
        if state_dict is not None:
            self.update_weights(state_dict)

    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Use these weights (HF names; a tied ``lm_head.weight`` may be absent). Tensors already on the
        rollout's device and dtype are referenced, not copied; tied embeddings are re-tied."""
        state = {k: v.detach().to(device=self._device, dtype=self._dtype) for k, v in state_dict.items()}
        if self.config.tie_word_embeddings:
            state["lm_head.weight"] = state.get("model.embed_tokens.weight")
        expected = self.model.state_dict()
        missing = [k for k in expected if state.get(k) is None]
        unexpected = [k for k in state if k not in expected]
        if missing or unexpected:
            raise StateDictError(
                f"state dict does not match {self.config.model_type} at {self.config.path!r}: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, tensor in expected.items():
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise StateDictError(f"{name} has shape {tuple(state[name].shape)}, expected {tuple(tensor.shape)}")
        self.model.load_state_dict(state, strict=True, assign=True)
        if self.config.tie_word_embeddings:
            # assign=True replaced both Parameters; make the head the embedding again.
            self.model.lm_head.weight = self.model.model.embed_tokens.weight
        self._has_weights = True

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    def _require_weights(self) -> None:
        if not self._has_weights:
            raise RuntimeError("the rollout has no weights yet; call update_weights(state_dict) first")

    def _prefill(self, prompts: list[list[int]], *, capacity: int, all_logits: bool):
        from transformers import DynamicCache

        tokens, is_token, positions, lengths = left_pad(prompts, pad_token_id=self.pad_token_id, device=self.device)
        cache = _HFDecodeCache(DynamicCache(config=self.model.config), is_token.long(), lengths.clone())
        out = self.model(
            input_ids=tokens,
            attention_mask=cache.attention_mask,
            position_ids=positions,
            past_key_values=cache.cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        )
        logits = out.logits.float()
        return cache, (logits if all_logits else logits[:, -1])

    def _decode_step(self, tokens: torch.Tensor, cache: _HFDecodeCache) -> torch.Tensor:
        positions = cache.next_position[:, None]
        cache.next_position = cache.next_position + 1
        cache.attention_mask = torch.cat([cache.attention_mask, torch.ones_like(positions)], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=cache.attention_mask,
            position_ids=positions,
            past_key_values=cache.cache,
            use_cache=True,
        )
        return out.logits[:, -1].float()
