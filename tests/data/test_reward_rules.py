"""Rewards: rule scorers on hand examples, dispatch, batch scoring, custom reward files."""

import pickle
import textwrap

import cloudpickle
import numpy as np
import pytest

from verl_balance.rewards import (
    RewardError,
    compute_score,
    extract_answer,
    load_reward_fn,
    score_batch,
)


@pytest.mark.parametrize(
    "data_source, solution, truth, expected",
    [
        ("synthetic/add", "579", "579", 1.0),
        ("synthetic/add", "  579\nextra text", "579", 1.0),  # answer = first non-empty line
        ("synthetic/add", "578", "579", 0.0),
        ("synthetic/add", "five", "579", 0.0),
        ("synthetic/reverse", "cba", "cba", 1.0),
        ("synthetic/reverse", "abc", "cba", 0.0),
        ("synthetic/sort", "0123", "0123", 1.0),
        ("synthetic/copy", "", "abc", 0.0),
    ],
)
def test_exact_match_scores_hand_examples(data_source, solution, truth, expected):
    result = compute_score(data_source, solution, truth)
    assert result["score"] == expected and result["acc"] == expected


def test_format_reward_separates_wrong_from_malformed():
    wrong = compute_score("synthetic/add", "578", "579", format_score=0.1)
    malformed = compute_score("synthetic/add", "57x", "579", format_score=0.1)
    assert (wrong["score"], wrong["acc"], wrong["format_ok"]) == (0.1, 0.0, 1.0)
    assert (malformed["score"], malformed["acc"], malformed["format_ok"]) == (0.0, 0.0, 0.0)


def test_extract_answer_takes_first_nonempty_line():
    assert extract_answer("\n\n 42 \n43") == "42" and extract_answer("   ") == ""


def test_unknown_data_source_names_the_known_ones():
    with pytest.raises(RewardError, match=r"'lighteval/MATH'.*'openai/gsm8k'.*synthetic/add"):
        compute_score("lighteval/MATH", "1", "1")


def test_score_batch_collects_scores_and_extras():
    scores, extras = score_batch(
        reward_fn=compute_score,
        data_sources=["synthetic/copy", "synthetic/sort"],
        solutions=["ab", "21"],
        ground_truths=["ab", "12"],
    )
    assert scores.tolist() == [1.0, 0.0] and extras["acc"].tolist() == [1.0, 0.0]


def test_score_batch_refuses_nan_and_non_numbers():
    with pytest.raises(RewardError, match="sample 1 .*finite"):
        score_batch(
            reward_fn=lambda *a: [1.0, float("nan")][len(a[1])],
            data_sources=["s", "s"],
            solutions=["", "x"],
            ground_truths=["", ""],
        )
    with pytest.raises(RewardError, match="no 'score' key"):
        score_batch(reward_fn=lambda *a: {"acc": 1.0}, data_sources=["s"], solutions=["x"], ground_truths=["x"])


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(
        textwrap.dedent("""
        def length_reward(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
            return scale * len(solution_str)

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str == ground_truth)
    """)
    )
    return str(path)


def test_load_reward_fn_defaults_to_builtin_and_loads_user_files(reward_file):
    assert load_reward_fn() is compute_score
    assert load_reward_fn(reward_file)("x", "a", "a") == 1.0
    fn = load_reward_fn(reward_file, "length_reward", reward_kwargs={"scale": 2.0})
    assert fn("x", "abc", "") == 6.0
    restored = pickle.loads(cloudpickle.dumps(fn))  # shipped by value to Ray workers
    assert restored("x", "ab", "") == 4.0


def test_load_reward_fn_errors_name_the_config_key(reward_file, tmp_path):
    with pytest.raises(RewardError, match=r"custom_reward_function.name='nope'.*\['compute_score', 'length_reward'\]"):
        load_reward_fn(reward_file, "nope")
    with pytest.raises(RewardError, match="custom_reward_function.path"):
        load_reward_fn(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(RewardError, match="failed to import.*boom"):
        load_reward_fn(str(broken))
    assert not np.isnan(compute_score("synthetic/add", "1", "1")["score"])
