"""A rule-based reward for ``test_verl_main_ppo.py`` (verl's ``reward.custom_reward_function``).

A tiny random model never answers a GSM8K question, so exact-match rewards would all be 0 and GRPO's
advantages with them (a PPO step with a zero gradient checks nothing). This score varies with the
response text: the share of digits in it, plus 1 for containing the ground truth.
"""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """Digit share of ``solution_str`` (0 for an empty one) plus 1 if ``ground_truth`` occurs in it."""
    digits = sum(ch.isdigit() for ch in solution_str)
    share = digits / len(solution_str) if solution_str else 0.0
    return share + float(str(ground_truth) in solution_str)
