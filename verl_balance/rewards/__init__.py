"""Rewards: verl-style ``compute_score`` dispatch, rule scorers for the synthetic tasks, custom loaders."""

from .custom import load_reward_fn
from .score import RewardError, compute_score, known_data_sources, register_scorer, score_batch
from .synthetic import extract_answer, score_task

__all__ = [
    "RewardError",
    "compute_score",
    "extract_answer",
    "known_data_sources",
    "load_reward_fn",
    "register_scorer",
    "score_batch",
    "score_task",
]
