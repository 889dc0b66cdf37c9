"""Greedy / temperature / top-p sampling against hand-computed distributions."""

import math

import pytest
import torch

from verl_balance.rollout import sample_next_tokens

PROBS = [0.5, 0.3, 0.15, 0.05]


def _draw(top_p: float, *, rows: int = 20000, temperature: float = 1.0):
    logits = torch.tensor(PROBS).log().repeat(rows, 1)
    gen = torch.Generator().manual_seed(0)
    return sample_next_tokens(logits, temperature=temperature, top_p=top_p, generator=gen)


@pytest.mark.parametrize("top_p,kept", [(0.45, [0]), (0.7, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_prefix_reaching_the_mass_and_renormalises(top_p, kept):
    tokens, log_probs = _draw(top_p)
    counts = torch.bincount(tokens, minlength=4).double() / len(tokens)
    mass = sum(PROBS[i] for i in kept)
    expected = torch.tensor([PROBS[i] / mass if i in kept else 0.0 for i in range(4)], dtype=torch.float64)
    torch.testing.assert_close(counts, expected, atol=0.015, rtol=0)
    # The reported log-prob is the untruncated policy's.
    torch.testing.assert_close(log_probs, torch.tensor(PROBS).log()[tokens])


def test_temperature_scales_logits_before_sampling():
    tokens, log_probs = _draw(1.0, temperature=2.0)
    tempered = torch.tensor([math.sqrt(p) for p in PROBS], dtype=torch.float64)
    tempered /= tempered.sum()
    counts = torch.bincount(tokens, minlength=4).double() / len(tokens)
    torch.testing.assert_close(counts, tempered, atol=0.015, rtol=0)
    torch.testing.assert_close(log_probs.double(), tempered.log()[tokens], atol=1e-6, rtol=0)


def test_greedy_takes_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 0.0, 0.0, 3.0]])
    tokens, log_probs = sample_next_tokens(logits, temperature=0.0, top_p=1.0, generator=None)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(log_probs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])
