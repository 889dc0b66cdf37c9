"""RL prompt dataset: verl schema, generation prompt, overlong filtering counted, malformed rows."""

import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_balance.data import (
    ByteTokenizer,
    MalformedRowError,
    RLDataConfig,
    RLPromptDataset,
    SequenceTooLongError,
)

BOS, SEP, PAD = ByteTokenizer.BOS, ByteTokenizer.SEP, ByteTokenizer.PAD


def _write(path, prompts, *, truths=None, sources=None):
    n = len(prompts)
    pq.write_table(
        pa.table(
            {
                "data_source": sources or ["synthetic/copy"] * n,
                "prompt": [[{"role": "user", "content": p}] for p in prompts],
                "reward_model": [{"style": "rule", "ground_truth": t} for t in (truths or ["x"] * n)],
                "extra_info": [{"index": i} for i in range(n)],
            }
        ),
        path,
    )
    return str(path)


def _dataset(path, **config):
    return RLPromptDataset(files=path, tokenizer=ByteTokenizer(), config=RLDataConfig(**config))


def test_prompt_ids_end_with_the_generation_prompt_and_carry_ground_truth(tmp_path):
    ds = _dataset(_write(tmp_path / "p.parquet", ["ab", "c"], truths=["ba", "c"]))
    assert ds[0].prompt_ids.tolist() == [BOS, ord("a"), ord("b"), SEP]
    assert ds[1].ground_truth == "c" and ds[1].data_source == "synthetic/copy" and ds[1].extra_info == {"index": 1}
    tensors, non_tensors = ds.collate([ds[0], ds[1]])
    assert tensors["input_ids"].tolist() == [[BOS, ord("a"), ord("b"), SEP], [BOS, ord("c"), SEP, PAD]]
    assert tensors["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert non_tensors["ground_truth"].dtype == object and list(non_tensors["ground_truth"]) == ["ba", "c"]
    assert list(non_tensors["raw_prompt_ids"][1]) == [BOS, ord("c"), SEP]


def test_overlong_prompts_are_filtered_and_counted(tmp_path):
    ds = _dataset(_write(tmp_path / "p.parquet", ["a", "abcdef", "ab", "abcdefgh"]), max_prompt_length=4)
    assert len(ds) == 2 and ds.num_filtered == 2
    assert ds.prompt_lens.tolist() == [3, 4]


def test_overlong_prompt_without_filter_errors_or_truncates(tmp_path):
    path = _write(tmp_path / "p.parquet", ["a", "abcdef"])
    with pytest.raises(SequenceTooLongError, match=r"p\.parquet: row 1: prompt has 8 tokens"):
        _dataset(path, max_prompt_length=4, filter_overlong_prompts=False)
    left = _dataset(path, max_prompt_length=4, filter_overlong_prompts=False, truncation="left")
    assert left[1].prompt_ids.tolist() == [ord("d"), ord("e"), ord("f"), SEP] and left.num_truncated == 1


def test_malformed_rl_rows_error_naming_row_or_are_skipped(tmp_path):
    path = str(tmp_path / "bad.parquet")
    pq.write_table(
        pa.table(
            {
                "data_source": ["synthetic/copy", "synthetic/copy", None],
                "prompt": [[{"role": "user", "content": "a"}]] * 3,
                "reward_model": [
                    {"style": "rule", "ground_truth": "a"},
                    {"style": "rule", "ground_truth": None},
                    {"style": "rule", "ground_truth": "a"},
                ],
            }
        ),
        path,
    )
    with pytest.raises(MalformedRowError, match=r"bad\.parquet: row 1: .*ground_truth"):
        _dataset(path)
    ds = _dataset(path, on_malformed="skip")
    assert len(ds) == 1 and [e.row for e in ds.skipped] == [1, 2]
    assert "data_source" in str(ds.skipped[1])


def _long_prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list("abcdefgh "), size=int(k))) for k in rng.integers(100, 400, size=n)]


def test_prompts_are_stored_in_at_most_6_bytes_per_token_and_read_back_exactly(tmp_path):
    prompts = _long_prompts(1500)
    truths = [str(i) for i in range(len(prompts))]
    path = _write(tmp_path / "p.parquet", prompts, truths=truths)
    RLPromptDataset(files=path, tokenizer=ByteTokenizer())  # warm lazy imports
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ds = RLPromptDataset(files=path, tokenizer=ByteTokenizer())
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    tokens = int(ds.prompt_lens.sum())
    assert ds.nbytes / tokens <= 6 and retained / tokens <= 6, (ds.nbytes / tokens, retained / tokens)
    for i in (0, 700, len(prompts) - 1):
        item = ds[i]
        assert item.prompt_ids.tolist() == [BOS, *prompts[i].encode(), SEP] and item.prompt_ids.dtype == np.int64
        assert item.raw_prompt == [{"role": "user", "content": prompts[i]}] and item.ground_truth == truths[i]
        assert item.extra_info == {"index": i} and item.index == i and ds.origin(i) == (path, i)


def test_fingerprint_changes_with_the_reward_target_only_when_it_changes(tmp_path):
    prompts = ["ab", "c", "de"]
    ds = RLPromptDataset(
        files=_write(tmp_path / "a.parquet", prompts, truths=["1", "2", "3"]), tokenizer=ByteTokenizer()
    )
    same = RLPromptDataset(
        files=_write(tmp_path / "b.parquet", prompts, truths=["1", "2", "3"]), tokenizer=ByteTokenizer()
    )
    other = RLPromptDataset(
        files=_write(tmp_path / "c.parquet", prompts, truths=["1", "2", "4"]), tokenizer=ByteTokenizer()
    )
    assert ds.fingerprint() == same.fingerprint() != other.fingerprint()
