"""CachedDecoder: the sampling loop every KV-cached backend shares (built-in and Hugging Face).

A backend supplies ``_prefill``, ``_decode_step`` and a cache with ``keep_rows``; the loop samples,
drops finished rows and assembles the ``RolloutOutput`` (invariants in ``rollout/base.py``).

Invariant each backend must keep: left padding and caching never change a real token's logits,
so generation is token-for-token equal to an uncached recompute of the same sequence.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, Protocol

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
from verl_balance.rollout.sampling import RowRandomStreams, check_seeds, sample_next_tokens


class DecodeCache(Protocol):
    """Per-row decoding state of one batch."""

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` (indices into the current batch)."""


class CachedDecoder(RolloutEngine):
    """Batched KV-cached sampling on top of a backend's ``_prefill`` / ``_decode_step``."""

    config: Any
    """The model's config (built-in ``ModelConfig`` or ``HFModelConfig``)."""
    pad_token_id: int
    max_batch_size: int | None

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding (token ids must be below it)."""
        return self.config.vocab_size

    @property
    def max_position_embeddings(self) -> int | None:
        """Longest prompt + response the model accepts (None: unbounded)."""
        return self.config.max_position_embeddings

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Device the decoder runs on."""

    @abc.abstractmethod
    def _require_weights(self) -> None:
        """Raise RuntimeError unless update_weights was called."""

    @abc.abstractmethod
    def _prefill(
        self, prompts: list[list[int]], *, capacity: int, all_logits: bool
    ) -> tuple[DecodeCache, torch.Tensor]:
        """Left-pad ``prompts``, run them into a fresh cache with room for ``capacity`` slots, and
        return it with the logits (B, L, V) if ``all_logits`` else those of the last slot (B, V)."""

    @abc.abstractmethod
    def _decode_step(self, tokens: torch.Tensor, cache: DecodeCache) -> torch.Tensor:
        """Append one token per row (B,); return next-token logits (B, V)."""

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
        seeds: Sequence[int] | None = None,
    ) -> RolloutOutput:
        """Sample ``n`` responses per prompt (rows prompt-major, see ``RolloutOutput``).

        ``seeds`` (one per prompt): response k of prompt i equals that of a call with the prompt alone, in
        any batch, order or chunking. ``seed`` instead seeds one generator shared by all rows."""
        self._require_weights()
        params = SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            max_response_length=max_response_length,
            stop_token_ids=tuple(stop_token_ids),
            seed=seed,
        )
        prompts = validate_prompts(prompts, vocab_size=self.vocab_size)
        self._check_positions(prompts, params.max_response_length)
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad_stop:
            raise RolloutInputError(f"stop_token_ids {bad_stop} outside [0, vocab_size={self.vocab_size})")

        generator, streams = self._random_sources(params, seeds=seeds, num_prompts=len(prompts))
        rows = [p for p in prompts for _ in range(params.n)]
        chunk = self.max_batch_size or len(rows)
        parts = [
            self._generate_chunk(rows[s : s + chunk], params, generator=generator, streams=streams, first_row=s)
            for s in range(0, len(rows), chunk)
        ]
        return _merge_chunks(parts, params, num_prompts=len(prompts), pad_token_id=self.pad_token_id)

    def _random_sources(
        self, params: SamplingParams, *, seeds: Sequence[int] | None, num_prompts: int
    ) -> tuple[torch.Generator | None, RowRandomStreams | None]:
        """(one generator for the call, or one stream per row) from ``params.seed`` or ``seeds`` (not both)."""
        if seeds is not None and params.seed is not None:
            raise RolloutInputError("pass either seed (one generator for the call) or seeds (one per prompt), not both")
        generator, streams = None, None
        if seeds is not None:
            seeds = check_seeds(seeds, num_prompts=num_prompts)
            if not params.greedy:
                streams = RowRandomStreams(seeds=seeds, n=params.n)
        elif params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return generator, streams

    def _check_positions(self, prompts: list[list[int]], max_response_length: int) -> None:
        limit = self.max_position_embeddings
        if limit is None:
            return
        for i, prompt in enumerate(prompts):
            if len(prompt) + max_response_length > limit:
                raise RolloutInputError(
                    f"prompt {i} has {len(prompt)} tokens; with max_response_length={max_response_length} it "
                    f"exceeds max_position_embeddings={limit}"
                )

    def _generate_chunk(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        generator: torch.Generator | None,
        streams: RowRandomStreams | None,
        first_row: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decode one batch (rows ``first_row`` on of the call); returns responses (B, R), log-probs
        (B, R), lengths (B,)."""
        device = self.device
        batch, max_len = len(prompts), params.max_response_length
        capacity = max(len(p) for p in prompts) + max_len
        cache, logits = self._prefill(prompts, capacity=capacity, all_logits=False)
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.int64, device=device)

        responses = torch.full((batch, max_len), self.pad_token_id, dtype=torch.int64, device=device)
        log_probs = torch.zeros(batch, max_len, dtype=torch.float32, device=device)
        lengths = torch.zeros(batch, dtype=torch.int64, device=device)
        running = torch.arange(batch, device=device)  # row of each sequence still in the cache
        row_uniforms = None if streams is None else streams.for_rows(first_row, batch, device=device)
        for step in range(max_len):
            uniforms = None if row_uniforms is None else row_uniforms(running, step)
            tokens, token_log_probs = sample_next_tokens(
                logits, temperature=params.temperature, top_p=params.top_p, generator=generator, uniforms=uniforms
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
        """Logits (len_i, V) at every position of each sequence via the generation path: the first
        ``prefill_lengths[i]`` tokens (default: all) prefilled, the rest fed one per decode step."""
        self._require_weights()
        sequences = validate_prompts(sequences, vocab_size=self.vocab_size)
        prefill_lengths = [len(s) for s in sequences] if prefill_lengths is None else list(prefill_lengths)
        valid = all(1 <= p <= len(s) for p, s in zip(prefill_lengths, sequences))
        if len(prefill_lengths) != len(sequences) or not valid:
            raise RolloutInputError("prefill_lengths needs one entry per sequence with 1 <= prefill_length <= len")
        prefixes = [s[:p] for s, p in zip(sequences, prefill_lengths)]
        longest_prefix = max(len(p) for p in prefixes)
        steps = [len(s) - p for s, p in zip(sequences, prefill_lengths)]
        cache, prefill_logits = self._prefill(prefixes, capacity=longest_prefix + max(steps), all_logits=True)
        per_sequence = [[prefill_logits[i, longest_prefix - len(p) :]] for i, p in enumerate(prefixes)]
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


def left_pad(prompts: list[list[int]], *, pad_token_id: int, device: torch.device):
    """Left-padded tokens (B, L), is_token (B, L) bool and positions (B, L) counting real tokens
    from 0 (0 on padding), plus prompt lengths (B,)."""
    longest = max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    tokens = torch.full((len(prompts), longest), pad_token_id, dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt) :] = torch.tensor(prompt)
    tokens = tokens.to(device)
    pad = (longest - lengths)[:, None]
    slot = torch.arange(longest, device=device)[None, :]
    return tokens, slot >= pad, (slot - pad).clamp(min=0), lengths


def _merge_chunks(parts: list[tuple], params: SamplingParams, *, num_prompts: int, pad_token_id: int) -> RolloutOutput:
    """The ``RolloutOutput`` of the chunks' (responses, log_probs, lengths) in row order, padded to
    the widest chunk; a response is finished by ``"stop"`` when it ends on a stop token."""
    width = max(part[0].shape[1] for part in parts)
    responses = torch.cat([F.pad(t, (0, width - t.shape[1]), value=pad_token_id) for t, _, _ in parts])
    log_probs = torch.cat([F.pad(lp, (0, width - lp.shape[1])) for _, lp, _ in parts])
    lengths = torch.cat([length for _, _, length in parts])
    response_mask = (torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]).long()
    last = responses.gather(1, (lengths - 1).clamp(min=0)[:, None]).squeeze(1)
    stopped = torch.isin(last, torch.tensor(params.stop_token_ids, dtype=torch.int64, device=last.device))
    return RolloutOutput(
        prompt_index=np.repeat(np.arange(num_prompts, dtype=np.int64), params.n),
        responses=responses,
        response_mask=response_mask,
        response_lengths=lengths,
        finish_reasons=np.where(stopped.cpu().numpy(), "stop", "length").astype(object),
        log_probs=log_probs,
    )
