"""NaiveRollout: batched, KV-cached, inference-only decoding of the built-in Llama-style model.

It reads the training model's state dict directly (parameter names and semantics are the
contract in HELPERS.md: RMSNorm in fp32, rotate_half RoPE over head_dim, GQA, SwiGLU, optional
tied embeddings), so a colocated actor can hand over ``full_state_dict()`` without conversion.

Invariants:
- Left-padded static cache: a batch of B sequences is left-padded to the longest prompt P, so
  every sequence writes its k-th generated token to the same cache slot P + k and decoding is one
  (B, 1) step per token. Pad slots are never attended to (a pad query attends to itself only, so
  no softmax row is empty); position ids count real tokens only and start at 0 for each
  sequence. Hence the logits of every real token equal a single-sequence, no-cache forward.
- Finished sequences (stop token or length) are removed from the batch and the cache at once,
  so later steps cost only the still-running sequences.
- Compute runs on the device and in the dtype of the state dict tensors (no_grad).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from verl_balance.rollout.base import (
    RolloutEngine,
    RolloutInputError,
    RolloutOutput,
    SamplingParams,
    validate_prompts,
)
from verl_balance.rollout.sampling import sample_next_tokens


class StateDictError(ValueError):
    """The state dict does not match the model config (missing key or wrong shape)."""


@dataclass(frozen=True)
class _Dims:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int | None
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config) -> _Dims:
        if config.hidden_size % config.num_heads or config.num_heads % config.num_kv_heads:
            raise StateDictError(
                f"hidden_size={config.hidden_size} must be divisible by num_heads={config.num_heads}, "
                f"and num_heads by num_kv_heads={config.num_kv_heads}"
            )
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_heads,
            rope_theta=float(getattr(config, "rope_theta", 10000.0)),
            rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
            max_position_embeddings=getattr(config, "max_position_embeddings", None),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        h, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        shapes = {"embed_tokens.weight": (self.vocab_size, h), "norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for i in range(self.num_layers):
            p = f"layers.{i}."
            shapes.update({
                p + "input_norm.weight": (h,),
                p + "attn.q_proj.weight": (self.num_heads * hd, h),
                p + "attn.k_proj.weight": (self.num_kv_heads * hd, h),
                p + "attn.v_proj.weight": (self.num_kv_heads * hd, h),
                p + "attn.o_proj.weight": (h, self.num_heads * hd),
                p + "post_attn_norm.weight": (h,),
                p + "mlp.gate_proj.weight": (f, h),
                p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f),
            })
        return shapes


class _KVCache:
    """Per-layer key/value buffers (B, num_kv_heads, capacity, head_dim) shared by B left-padded rows."""

    def __init__(self, *, dims: _Dims, batch: int, capacity: int, dtype: torch.dtype, device: torch.device):
        shape = (batch, dims.num_kv_heads, capacity, dims.head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(dims.num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(dims.num_layers)]
        self.slot_is_token = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.next_position = torch.zeros(batch, dtype=torch.int64, device=device)
        self.filled = 0

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` (indices into the current batch)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.slot_is_token = self.slot_is_token.index_select(0, rows)
        self.next_position = self.next_position.index_select(0, rows)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class NaiveRollout(RolloutEngine):
    """Built-in rollout backend: HF-Llama-semantics decoder with a left-padded KV cache."""

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
        """``model_config``: a ModelConfig (vocab_size, hidden_size, ..., tie_word_embeddings).
        ``max_batch_size`` bounds the sequences decoded together (memory); None = all at once.
        ``device`` / ``dtype``: where and in which precision to decode; None keeps those of the
        state dict (its tensors are then referenced, not copied)."""
        if max_batch_size is not None and max_batch_size < 1:
            raise RolloutInputError(f"max_batch_size={max_batch_size} must be >= 1 or None")
        self.dims = _Dims.from_config(model_config)
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
        expected = self.dims.expected_shapes()
        missing = [k for k in expected if k not in state_dict]
        if missing:
            raise StateDictError(f"state dict lacks {missing[:5]} (and {max(0, len(missing) - 5)} more)")
        for name, shape in expected.items():
            if tuple(state_dict[name].shape) != shape:
                raise StateDictError(f"{name} has shape {tuple(state_dict[name].shape)}, expected {shape}")
        weights = {
            k: state_dict[k].detach().to(device=self._target_device, dtype=self._target_dtype) for k in expected
        }
        devices = {w.device for w in weights.values()}
        dtypes = {w.dtype for w in weights.values()}
        if len(devices) != 1 or len(dtypes) != 1:
            raise StateDictError(f"all weights must share one device and dtype, got {devices} and {dtypes}")
        self._weights = weights

    @property
    def device(self) -> torch.device:
        """Device the decoder runs on (that of its weights)."""
        return self._require_weights()["embed_tokens.weight"].device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype (that of its weights; RMSNorm still normalizes in fp32)."""
        return self._require_weights()["embed_tokens.weight"].dtype

    def _require_weights(self) -> dict[str, torch.Tensor]:
        if self._weights is None:
            raise RuntimeError("NaiveRollout has no weights yet; call update_weights(state_dict) first")
        return self._weights

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
        """Run T new tokens per row through the model, appending them to ``cache``.

        tokens/positions/is_token: (B, T). Returns logits (B, T, V) or, unless ``all_logits``,
        those of the last position (B, V).
        """
        w, d = self._weights, self.dims
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

        inv_freq = 1.0 / (d.rope_theta ** (torch.arange(0, d.head_dim, 2, device=tokens.device).float() / d.head_dim))
        angles = positions.float()[..., None] * inv_freq
        angles = torch.cat((angles, angles), dim=-1)[:, None]  # (B, 1, T, hd)
        cos, sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)

        hidden = F.embedding(tokens, w["embed_tokens.weight"])
        for i in range(d.num_layers):
            p = f"layers.{i}."
            x = _rms_norm(hidden, w[p + "input_norm.weight"], d.rms_norm_eps)
            q = F.linear(x, w[p + "attn.q_proj.weight"]).view(batch, num_new, d.num_heads, d.head_dim)
            k = F.linear(x, w[p + "attn.k_proj.weight"]).view(batch, num_new, d.num_kv_heads, d.head_dim)
            v = F.linear(x, w[p + "attn.v_proj.weight"]).view(batch, num_new, d.num_kv_heads, d.head_dim)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            cache.keys[i][:, :, start:end] = k
            cache.values[i][:, :, start:end] = v
            attn = F.scaled_dot_product_attention(
                q,
                cache.keys[i][:, :, :end],
                cache.values[i][:, :, :end],
                attn_mask=visible,
                scale=1.0 / math.sqrt(d.head_dim),
                enable_gqa=d.num_heads != d.num_kv_heads,
            )
            attn = attn.transpose(1, 2).reshape(batch, num_new, d.num_heads * d.head_dim)
            hidden = hidden + F.linear(attn, w[p + "attn.o_proj.weight"])
            x = _rms_norm(hidden, w[p + "post_attn_norm.weight"], d.rms_norm_eps)
            gate = F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"]))
            hidden = hidden + F.linear(gate * F.linear(x, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])

        hidden = _rms_norm(hidden if all_logits else hidden[:, -1], w["norm.weight"], d.rms_norm_eps)
        head = w["embed_tokens.weight"] if d.tie_word_embeddings else w["lm_head.weight"]
        return F.linear(hidden, head)

    def _prefill(self, prompts: list[list[int]], *, capacity: int, all_logits: bool) -> tuple[_KVCache, torch.Tensor]:
        """Left-pad ``prompts``, fill a fresh cache with them, return it and the prefill logits."""
        device = self.device
        longest = max(len(p) for p in prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        tokens = torch.full((len(prompts), longest), self.pad_token_id, dtype=torch.int64)
        for row, prompt in enumerate(prompts):
            tokens[row, longest - len(prompt):] = torch.tensor(prompt)
        tokens = tokens.to(device)
        pad = (longest - lengths)[:, None]
        slot = torch.arange(longest, device=device)[None, :]
        is_token = slot >= pad
        positions = (slot - pad).clamp(min=0)
        cache = _KVCache(dims=self.dims, batch=len(prompts), capacity=capacity, dtype=self.dtype, device=device)
        cache.next_position = lengths.clone()
        logits = self._forward(tokens, positions, is_token, cache, all_logits=all_logits)
        return cache, logits

    def _decode_step(self, tokens: torch.Tensor, cache: _KVCache) -> torch.Tensor:
        """Append one token per row; return next-token logits (B, V)."""
        positions = cache.next_position[:, None]
        cache.next_position = cache.next_position + 1
        is_token = torch.ones_like(tokens, dtype=torch.bool)[:, None]
        return self._forward(tokens[:, None], positions, is_token, cache, all_logits=False)

    # ------------------------------------------------------------------ public
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_response_length: int = 256,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
    ) -> RolloutOutput:
        """Sample ``n`` responses per prompt (rows prompt-major, see ``RolloutOutput``)."""
        self._require_weights()
        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_response_length=max_response_length,
            stop_token_ids=tuple(stop_token_ids),
            seed=seed,
        )
        prompts = validate_prompts(prompts, vocab_size=self.dims.vocab_size)
        self._check_positions(prompts, params.max_response_length)
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.dims.vocab_size]
        if bad_stop:
            raise RolloutInputError(f"stop_token_ids {bad_stop} outside [0, vocab_size={self.dims.vocab_size})")

        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        rows = [p for p in prompts for _ in range(params.n)]
        chunk = self.max_batch_size or len(rows)
        parts = [self._generate_chunk(rows[s:s + chunk], params, generator) for s in range(0, len(rows), chunk)]

        width = max(part[0].shape[1] for part in parts)
        responses = torch.cat([F.pad(t, (0, width - t.shape[1]), value=self.pad_token_id) for t, _, _ in parts])
        log_probs = torch.cat([F.pad(lp, (0, width - lp.shape[1])) for _, lp, _ in parts])
        lengths = torch.cat([length for _, _, length in parts])
        response_mask = (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()
        last = responses.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
        stopped = torch.isin(last, torch.tensor(params.stop_token_ids, dtype=torch.int64, device=last.device))
        return RolloutOutput(
            prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int64), params.n),
            responses=responses,
            response_mask=response_mask,
            response_lengths=lengths,
            finish_reasons=np.where(stopped.cpu().numpy(), "stop", "length").astype(object),
            log_probs=log_probs,
        )

    def _check_positions(self, prompts: list[list[int]], max_response_length: int) -> None:
        limit = self.dims.max_position_embeddings
        if limit is None:
            return
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_response_length > limit:
                raise RolloutInputError(
                    f"prompt {i} has {len(prompt)} tokens; with max_response_length={max_response_length} it "
                    f"exceeds max_position_embeddings={limit}"
                )

    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode one batch; returns responses (B, R), log-probs (B, R), lengths (B,)."""
        device = self.device
        batch, max_len = len(prompts), params.max_response_length
        capacity = max(len(p) for p in prompts) + max_len
        cache, logits = self._prefill(prompts, capacity=capacity, all_logits=False)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.int64, device=device)

        responses = torch.full((batch, max_len), self.pad_token_id, dtype=torch.int64, device=device)
        log_probs = torch.zeros(batch, max_len, dtype=torch.float32, device=device)
        lengths = torch.zeros(batch, dtype=torch.int64, device=device)
        running = torch.arange(batch, device=device)  # row of each sequence still in the cache
        for step in range(max_len):
            tokens, token_log_probs = sample_next_tokens(
                logits, temperature=params.temperature, top_p=params.top_p, generator=generator
            )
            responses[running, step] = tokens
            log_probs[running, step] = token_log_probs
            lengths[running] = step + 1
            if step == max_len - 1:
                break
            keep = ~torch.isin(tokens, stop_ids)
            if not bool(keep.all()):
                if not bool(keep.any()):
                    break
                kept = keep.nonzero().squeeze(1)
                running, tokens = running[kept], tokens[kept]
                cache.keep_rows(kept)
            logits = self._decode_step(tokens, cache)
        width = int(lengths.max())
        return responses[:, :width], log_probs[:, :width], lengths

    @torch.no_grad()
    def forward_logits(
        self, sequences: Sequence[Sequence[int]], *, prefill_lengths: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Logits (len_i, V) for every position of each sequence, via the generation code path:
        the first ``prefill_lengths[i]`` tokens (default: all) are prefilled, the rest are fed one
        token per cached decode step (teacher forcing). For checks against the training model."""
        self._require_weights()
        sequences = validate_prompts(sequences, vocab_size=self.dims.vocab_size)
        prefill_lengths = [len(s) for s in sequences] if prefill_lengths is None else list(prefill_lengths)
        valid = all(1 <= p <= len(s) for p, s in zip(prefill_lengths, sequences))
        if len(prefill_lengths) != len(sequences) or not valid:
            raise RolloutInputError("prefill_lengths needs one entry per sequence with 1 <= prefill_length <= len")
        prefixes = [s[:p] for s, p in zip(sequences, prefill_lengths)]
        longest_prefix = max(len(p) for p in prefixes)
        steps = [len(s) - p for s, p in zip(sequences, prefill_lengths)]
        cache, prefill_logits = self._prefill(prefixes, capacity=longest_prefix + max(steps), all_logits=True)
        per_sequence = [[prefill_logits[i, longest_prefix - len(p):]] for i, p in enumerate(prefixes)]
        running = list(range(len(sequences)))
        for step in range(max(steps)):
            kept = [j for j, row in enumerate(running) if steps[row] > step]
            if len(kept) < len(running):
                cache.keep_rows(torch.tensor(kept, device=self.device))
                running = [running[j] for j in kept]
            tokens = torch.tensor([sequences[row][prefill_lengths[row] + step] for row in running], device=self.device)
            logits = self._decode_step(tokens, cache)
            for j, row in enumerate(running):
                per_sequence[row].append(logits[j : j + 1])
        return [torch.cat(parts) for parts in per_sequence]
