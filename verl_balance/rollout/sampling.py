"""Next-token sampling: greedy, temperature and nucleus (top-p).

Randomness: ``uniforms`` (B,) in [0, 1) with inverse-CDF sampling (with ``RowRandomStreams`` a row's
tokens depend only on its own seed and logits), or one ``generator`` shared by the batch
(``torch.multinomial``; a row's numbers depend on the batch layout).

Invariants:
- temperature == 0 is argmax (ties -> lowest token id) and draws no random numbers.
- top-p keeps the smallest prefix of tokens (by probability, descending, ties by id) whose mass
  reaches top_p, always at least the most likely token; top_p -> 0 is greedy.
- The reported log-prob is log_softmax(logits / temperature) of the sampled token, before top-p.
- Inverse-CDF sampling never returns a token of probability 0 (after top-p).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from verl_balance.rollout.base import RolloutInputError

_SEED_LIMIT = 1 << 64


class RowRandomStreams:
    """Per-response-row uniform streams: row (prompt i, response k) draws at step t the t-th number of a
    Philox stream keyed by ``(seeds[i], k)``, drawn on the host so CPU and CUDA consume the same numbers."""

    def __init__(self, *, seeds: Sequence[int], n: int):
        """One stream for each of the ``len(seeds) * n`` rows of a call (prompt-major)."""
        self._keys = [(int(seed), k) for seed in seeds for k in range(n)]

    def for_rows(self, first_row: int, num_rows: int, *, device: torch.device, block_steps: int = 256) -> RowUniforms:
        """Uniforms of rows ``first_row .. first_row + num_rows - 1`` (one decoded batch), from step 0."""
        generators = [
            np.random.Generator(np.random.Philox(np.random.SeedSequence(list(key))))
            for key in self._keys[first_row : first_row + num_rows]
        ]
        return RowUniforms(generators, device=device, block_steps=block_steps)


class RowUniforms:
    """The uniforms of one decoded batch, drawn ``block_steps`` steps at a time for the running rows."""

    def __init__(self, generators: list[np.random.Generator], *, device: torch.device, block_steps: int):
        """``generators[b]``: the unread stream of batch row b."""
        assert block_steps >= 1
        self._generators, self._device, self._block_steps = generators, device, block_steps
        self._block: torch.Tensor | None = None  # (running rows at the block's start, block_steps)
        self._slot = torch.full((len(generators),), -1, dtype=torch.int64, device=device)

    def __call__(self, running: torch.Tensor, step: int) -> torch.Tensor:
        """Uniforms (len(running),) of decoding step ``step`` for batch rows ``running``. Steps must
        come in order from 0 and ``running`` may only shrink, so each stream is read in order."""
        offset = step % self._block_steps
        if offset == 0:
            rows = running.tolist()
            block = np.stack([self._generators[r].random(self._block_steps) for r in rows])
            self._block = torch.from_numpy(block).to(self._device)
            self._slot[running] = torch.arange(len(rows), device=self._device)
        assert self._block is not None, "RowUniforms must be read from step 0"
        return self._block[self._slot[running], offset]


def check_seeds(seeds: Sequence[int], *, num_prompts: int) -> tuple[int, ...]:
    """Seeds as a tuple of ints in [0, 2**64), one per prompt; raise a ``RolloutInputError`` otherwise."""
    seeds = tuple(seeds)
    if len(seeds) != num_prompts:
        raise RolloutInputError(f"seeds has {len(seeds)} entries; pass one per prompt ({num_prompts})")
    for i, seed in enumerate(seeds):
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < _SEED_LIMIT:
            raise RolloutInputError(f"seeds[{i}]={seed!r} must be an int in [0, 2**64)")
    return tuple(int(s) for s in seeds)


def sample_next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (B, V); return (tokens (B,) int64, log_probs (B,) fp32).
    ``uniforms``: inverse-CDF, row b decided by ``uniforms[b]`` alone; else ``torch.multinomial``."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        log_probs = torch.log_softmax(logits, dim=-1)
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
    if uniforms is not None:
        assert uniforms.shape == logits.shape[:1], (uniforms.shape, logits.shape)

    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    probs = log_probs.exp()
    if top_p < 1:
        sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        if uniforms is None:
            choice = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(-1)
        else:
            choice = _inverse_cdf(sorted_probs, uniforms)
        tokens = sorted_ids.gather(-1, choice[:, None]).squeeze(-1)
    elif uniforms is None:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    else:
        tokens = _inverse_cdf(probs, uniforms)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index j (B,) of the first cumulative weight above ``uniforms * total`` (fp64, row by row)."""
    cumulative = torch.cumsum(weights.double(), dim=-1)
    threshold = uniforms.double()[:, None] * cumulative[:, -1:]
    choice = torch.searchsorted(cumulative, threshold, right=True).squeeze(-1)
    # threshold < total, but rounding can put it on the total: then take the last positive weight
    # (a weight-0 token has cumulative == its predecessor's, so searchsorted never lands on one).
    positive = weights > 0
    last_positive = weights.shape[-1] - 1 - positive.flip(-1).int().argmax(-1)
    return torch.minimum(choice, last_positive)
