"""Next-token sampling: greedy, temperature and nucleus (top-p), driven by a torch.Generator.

Invariants:
- temperature == 0 is argmax (ties -> lowest token id); the reported log-prob is then
  log_softmax(logits) of that token.
- top-p keeps the smallest prefix of tokens (sorted by probability, descending, ties by id)
  whose mass reaches top_p, always at least the most likely token; so top_p -> 0 is greedy.
- The reported log-prob is log_softmax(logits / temperature) of the sampled token, before the
  top-p truncation (the policy's log-prob, not the truncated sampler's).
"""

from __future__ import annotations

import torch


def sample_next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (B, V); return (tokens (B,) int64, log_probs (B,) fp32)."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
        log_probs = torch.log_softmax(logits, dim=-1)
        return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)

    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    probs = log_probs.exp()
    if top_p < 1:
        sorted_probs, sorted_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        tokens = sorted_ids.gather(-1, choice).squeeze(-1)
    else:
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
