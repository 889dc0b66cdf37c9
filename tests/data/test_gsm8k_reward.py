"""The built-in ``openai/gsm8k`` rule (a verl gsm8k launch script passes no reward function): the last
``#### <number>`` of the response's tail, compared with verl's own gsm8k rule where verl is installed,
and through the data_source dispatch the trainer uses."""

from __future__ import annotations

import pytest

from tests.data.gsm8k_tiny import gsm8k_rows
from verl_balance.rewards import compute_score
from verl_balance.rewards.gsm8k import TAIL_CHARS, score_gsm8k

TRUTH = gsm8k_rows(1)[0]["reward_model"]["ground_truth"]
RESPONSES = [
    f"so #### 3 then #### {TRUTH}",  # the last answer counts
    f"#### {TRUTH} no, #### {int(TRUTH) + 1}",
    f"the answer is {TRUTH}",  # strict: needs ####
    "#### 1,234",
    "#### $1234",
    f"#### -{TRUTH}",
    f"#### {TRUTH}" + " pad" * TAIL_CHARS,  # beyond the tail: not read
    "",
]


def test_gsm8k_rows_are_in_verls_layout_and_dispatch_to_the_gsm8k_rule():
    row = gsm8k_rows(1)[0]
    assert row["data_source"] == "openai/gsm8k" and row["prompt"][0]["role"] == "user"
    assert compute_score("openai/gsm8k", f"x #### {TRUTH}", TRUTH) == {"score": 1.0, "acc": 1.0, "format_ok": 1.0}
    assert compute_score("openai/gsm8k", "#### 1,234", "1234", format_score=0.1)["score"] == 1.0
    wrong = compute_score("openai/gsm8k", "#### 7", "8", format_score=0.1)
    assert wrong == {"score": 0.1, "acc": 0.0, "format_ok": 1.0}
    assert compute_score("openai/gsm8k", "7", "7", format_score=0.1)["score"] == 0.0


@pytest.mark.parametrize("response", RESPONSES)
@pytest.mark.parametrize("ground_truth", [TRUTH, "1234"])
def test_gsm8k_rule_equals_verls_strict_rule(response, ground_truth):
    verl_gsm8k = pytest.importorskip("verl.utils.reward_score.gsm8k")
    for format_score in (0.0, 0.25):
        ours = score_gsm8k(solution_str=response, ground_truth=ground_truth, format_score=format_score)["score"]
        theirs = verl_gsm8k.compute_score(response, ground_truth, method="strict", format_score=format_score)
        assert ours == theirs, (response, ground_truth, format_score)
