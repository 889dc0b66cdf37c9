"""verl's own trainers honour our reward spelling: with ``patch_verl`` (``autopatch``), verl's reward
loader reads the top-level ``custom_reward_function`` when verl's ``reward.custom_reward_function`` is
unset (verl 0.9.1 alone ignores it: the negative control). The config is verl's own generated one."""

from __future__ import annotations

import os

import pytest

from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)
verl_reward = pytest.importorskip("verl.trainer.ppo.reward", reason="verl's reward module needs its optional deps")

from omegaconf import OmegaConf  # noqa: E402

from verl_balance.integrations import verl as integration  # noqa: E402

PPO_CONFIG = os.path.join(os.path.dirname(verl_reward.__file__), "..", "config", "_generated_ppo_trainer.yaml")
REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {score}\n"


def _config(tmp_path, *, ours=None, ours_name=None, theirs=None):
    cfg = OmegaConf.load(PPO_CONFIG)
    cfg.custom_reward_function.path = ours
    cfg.custom_reward_function.name = ours_name
    cfg.reward.custom_reward_function.path = theirs
    return cfg


def _reward_file(tmp_path, name: str, score: float) -> str:
    path = tmp_path / name
    path.write_text(REWARD.format(score=score))
    return str(path)


def _score(fn) -> float:
    return fn(data_source="synthetic/add", solution_str="4", ground_truth="4", extra_info={})


def test_verl_alone_ignores_the_top_level_reward_key(tmp_path):
    cfg = _config(tmp_path, ours=_reward_file(tmp_path, "ours.py", 0.25))
    assert verl_reward.get_custom_reward_fn(cfg) is None  # the bug: verl then fails after the rollout


def test_patched_verl_loads_the_top_level_reward_when_verls_key_is_unset(tmp_path):
    cfg = _config(tmp_path, ours=_reward_file(tmp_path, "ours.py", 0.25))  # name null = compute_score
    with integration.patch_verl():
        fn = verl_reward.get_custom_reward_fn(cfg)
    assert _score(fn) == 0.25
    assert verl_reward.get_custom_reward_fn(cfg) is None  # undo restores verl's loader


def test_verls_own_reward_key_wins_when_set(tmp_path):
    theirs = _reward_file(tmp_path, "theirs.py", 0.75)
    cfg = _config(tmp_path, theirs=theirs)
    with integration.patch_verl():
        assert _score(verl_reward.get_custom_reward_fn(cfg)) == 0.75
        same = _config(tmp_path, ours=theirs, theirs=theirs)
        assert _score(verl_reward.get_custom_reward_fn(same)) == 0.75


def test_two_reward_files_are_refused_naming_both_keys(tmp_path):
    cfg = _config(tmp_path, ours=_reward_file(tmp_path, "a.py", 0.1), theirs=_reward_file(tmp_path, "b.py", 0.2))
    with integration.patch_verl(), pytest.raises(ValueError, match=r"custom_reward_function\.path.*reward\."):
        verl_reward.get_custom_reward_fn(cfg)
