"""The rollout interface: sample n responses per prompt from the current policy weights.

Invariants (every backend: the built-in ``KVCacheRollout``, ``HFRollout``, ``VLLMRollout``):
- Output rows are prompt-major and interleaved: row k answers prompt ``k // n`` (verl's
  ``repeat(n, interleave=True)``).
- ``responses`` is right-padded with ``pad_token_id``; ``response_mask[k, j] = 1`` exactly for the
  generated tokens. A response ends with the first stop token (included, masked 1) or after
  ``max_response_length`` tokens.
- ``log_probs[k, j]`` (when returned) is log softmax(logits / temperature) of the sampled token
  (temperature 1 for greedy), before top-p filtering; 0 on padding.
- Same prompts, parameters, seed and weights -> identical output.
- With per-prompt ``seeds``, a prompt's responses do not depend on the rest of the call, up to
  batch-shape-dependent rounding of the logits (which rarely flips a token).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch


class RolloutInputError(ValueError):
    """Bad prompts or sampling parameters."""


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters of one ``generate`` call (verl's rollout key names)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_length: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.n, int) and self.n >= 1):
            raise RolloutInputError(f"n={self.n!r} must be an int >= 1 (responses per prompt)")
        if not self.temperature >= 0:
            raise RolloutInputError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise RolloutInputError(f"top_p={self.top_p} must be in (0, 1]")
        if not (isinstance(self.max_response_length, int) and self.max_response_length >= 1):
            raise RolloutInputError(f"max_response_length={self.max_response_length!r} must be an int >= 1")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RolloutOutput:
    """Responses of one ``generate`` call; N = len(prompts) * n rows, R = longest response."""

    prompt_index: np.ndarray  # (N,) int64, prompt answered by each row
    responses: torch.Tensor  # (N, R) int64, right-padded with pad_token_id
    response_mask: torch.Tensor  # (N, R) int64, 1 on generated tokens
    response_lengths: torch.Tensor  # (N,) int64
    finish_reasons: np.ndarray  # (N,) object: "stop" | "length"
    log_probs: torch.Tensor | None = None  # (N, R) float32, 0 on padding
    # Multi-turn rollouts (rollout/agent_loop.py) form each row's prompt themselves (the chat with the
    # tools' schemas): the prompt ids per row, and per-row turn counts (name -> (N,) array).
    prompts: list[list[int]] | None = None
    turn_stats: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.prompt_index)

    def response_token_lists(self) -> list[list[int]]:
        """Each response as a list of token ids, without padding."""
        responses = self.responses.cpu().tolist()
        return [row[:length] for row, length in zip(responses, self.response_lengths.tolist())]


def validate_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int) -> list[list[int]]:
    """Prompts as lists of ints; raise naming the first bad prompt (empty, or token out of range)."""
    if len(prompts) == 0:
        raise RolloutInputError("prompts is empty; pass at least one prompt (a list of token ids)")
    checked = []
    for i, prompt in enumerate(prompts):
        tokens = [int(t) for t in prompt]
        if not tokens:
            raise RolloutInputError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise RolloutInputError(f"prompt {i} has token ids {bad[:5]} outside [0, vocab_size={vocab_size})")
        checked.append(tokens)
    return checked


class RolloutEngine(abc.ABC):
    """Generates responses from policy weights; a vLLM/SGLang backend implements the same two methods."""

    streams_weights: bool = False
    """True when ``load_weights`` copies a stream of tensors into the engine's own storage (vLLM)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Use the ``(name, tensor)`` pairs (a full state) from now on; returns how many were read."""
        state = dict(weights)
        self.update_weights(state)
        return len(state)

    @abc.abstractmethod
    def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Use these unsharded policy weights (the training model's own parameter names) from now on."""

    @abc.abstractmethod
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
        """Sample ``n`` responses per prompt (module invariants). ``seeds``: one per prompt, response k of
        prompt i then depends only on weights, prompt, parameters and ``(seeds[i], k)``; ``seed``: one seed."""
