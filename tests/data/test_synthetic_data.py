"""Synthetic tasks: deterministic, correct answers, wide length spread, verl schemas."""

import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from verl_balance.data.synthetic import (
    SyntheticConfig,
    SyntheticConfigError,
    generate_samples,
    main,
    write_dataset,
)
from verl_balance.rewards import compute_score


def _independent_answer(task, prompt):
    if task == "add":
        a, b = re.fullmatch(r"(\d+)\+(\d+)=", prompt).groups()
        return str(int(a) + int(b))
    word = prompt.split(" ", 1)[1]
    return {"reverse": word[::-1], "sort": "".join(sorted(word)), "copy": word}[task]


def test_same_seed_same_samples_and_different_seed_differs():
    a = generate_samples(num_samples=200, seed=3)
    assert a == generate_samples(num_samples=200, seed=3)
    assert a != generate_samples(num_samples=200, seed=4)


def test_every_answer_is_the_independent_solution_of_its_prompt():
    samples = generate_samples(num_samples=400, seed=0)
    assert {s.task for s in samples} == {"add", "reverse", "sort", "copy"}
    for s in samples:
        assert s.answer == _independent_answer(s.task, s.prompt), s


def test_sizes_spread_over_an_order_of_magnitude_within_bounds():
    config = SyntheticConfig(median_size=8, sigma=1.0, max_size=64)
    sizes = np.array([s.size for s in generate_samples(num_samples=2000, seed=1, config=config)])
    assert sizes.min() >= 1 and sizes.max() <= 64
    assert np.percentile(sizes, 95) / np.percentile(sizes, 5) > 10
    assert 6 <= np.median(sizes) <= 10


def test_invalid_config_names_the_setting():
    with pytest.raises(SyntheticConfigError, match="tasks"):
        SyntheticConfig(tasks=("multiply",))
    with pytest.raises(SyntheticConfigError, match="max_size"):
        SyntheticConfig(min_size=5, max_size=2)


def test_written_files_follow_verl_schemas_and_ground_truth_scores_one(tmp_path):
    paths = write_dataset(out_dir=str(tmp_path), num_train=50, num_val=10, seed=0)
    sft = pq.read_table(paths["sft_train"]).to_pylist()
    rl = pq.read_table(paths["rl_val"]).to_pylist()
    assert len(sft) == 50 and len(rl) == 10
    row = sft[0]
    assert row["messages"] == [
        {"role": "user", "content": row["prompt"]},
        {"role": "assistant", "content": row["response"]},
    ]
    for r in rl:
        assert r["reward_model"]["style"] == "rule"
        assert r["prompt"][0]["role"] == "user" and r["extra_info"]["split"] == "val"
        truth = r["reward_model"]["ground_truth"]
        assert compute_score(r["data_source"], truth, truth)["score"] == 1.0
        assert compute_score(r["data_source"], truth + "0", truth)["score"] == 0.0


def test_val_split_does_not_depend_on_train_size(tmp_path):
    a = write_dataset(out_dir=str(tmp_path / "a"), num_train=10, num_val=20, seed=5)
    b = write_dataset(out_dir=str(tmp_path / "b"), num_train=30, num_val=20, seed=5)
    assert pq.read_table(a["rl_val"]).equals(pq.read_table(b["rl_val"]))


def test_cli_writes_four_files(tmp_path, capsys):
    main(["--out", str(tmp_path), "--num-train", "8", "--num-val", "4", "--seed", "1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rl_train.parquet",
        "rl_val.parquet",
        "sft_train.parquet",
        "sft_val.parquet",
    ]
    assert "train: 8 samples" in capsys.readouterr().err


def test_sft_defects_repeat_the_last_character_of_train_answers_only(tmp_path):
    clean = write_dataset(out_dir=str(tmp_path / "clean"), num_train=400, num_val=50, seed=5)
    noisy = write_dataset(out_dir=str(tmp_path / "noisy"), num_train=400, num_val=50, seed=5, sft_defect_rate=0.6)
    exact = pq.read_table(clean["sft_train"]).to_pylist()
    rows = pq.read_table(noisy["sft_train"]).to_pylist()
    defective = 0
    for clean_row, row in zip(exact, rows, strict=True):
        answer = clean_row["response"]
        assert row["prompt"] == clean_row["prompt"]
        assert row["response"] in (answer, answer + answer[-1])
        assert row["messages"][1]["content"] == row["response"]
        defective += row["response"] != answer
    assert 0.5 < defective / len(rows) < 0.7  # 400 Bernoulli(0.6) draws
    # The verifier's side and every validation row stay exact; rate 0 is the clean dataset.
    for name in ("rl_train", "rl_val", "sft_val"):
        assert pq.read_table(noisy[name]).equals(pq.read_table(clean[name])), name
    zero = write_dataset(out_dir=str(tmp_path / "zero"), num_train=400, num_val=50, seed=5, sft_defect_rate=0.0)
    assert pq.read_table(zero["sft_train"]).equals(pq.read_table(clean["sft_train"]))


def test_sft_defect_rate_outside_zero_one_is_refused(tmp_path):
    with pytest.raises(SyntheticConfigError, match="sft_defect_rate=1.5"):
        write_dataset(out_dir=str(tmp_path), num_train=4, num_val=2, seed=0, sft_defect_rate=1.5)
