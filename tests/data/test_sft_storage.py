"""SFT dataset storage: compact flat arrays, equality with an independent per-row reference, resume."""

import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from verl_balance.data import ByteTokenizer, DataError, SFTDataConfig, SFTDataset, StatefulDataLoader

BOS, SEP, EOS = ByteTokenizer.BOS, ByteTokenizer.SEP, ByteTokenizer.EOS


def _rows(num_rows, *, seed=0, max_len=300):
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghij é"))  # includes a 2-byte UTF-8 character
    lengths = rng.integers(1, max_len, size=(num_rows, 2))
    return [("".join(rng.choice(letters, p)), "".join(rng.choice(letters, r))) for p, r in lengths]


def _write_parquet(path, rows):
    pq.write_table(pa.table({"prompt": [p for p, _ in rows], "response": [r for _, r in rows]}), str(path))
    return str(path)


def _reference(prompt, response):
    """Byte tokenizer's format written out by hand: [BOS] prompt [SEP] response [EOS]; targets = response + EOS."""
    p, r = list(prompt.encode()), list(response.encode())
    return [BOS, *p, SEP, *r, EOS], [0] * (len(p) + 2) + [1] * (len(r) + 1)


def test_every_sample_equals_the_hand_built_reference(tmp_path):
    rows = _rows(300)
    path = _write_parquet(tmp_path / "d.parquet", rows)
    ds = SFTDataset(files=path, tokenizer=ByteTokenizer(), config=SFTDataConfig(max_length=4096))
    assert len(ds) == len(rows)
    for i, (prompt, response) in enumerate(rows):
        ids, mask = _reference(prompt, response)
        assert ds[i]["input_ids"].tolist() == ids and ds[i]["loss_mask"].tolist() == mask, f"sample {i}"
        assert ds[i]["input_ids"].dtype == ds[i]["loss_mask"].dtype == torch.long
    assert ds.seq_lens.tolist() == [len(_reference(p, r)[0]) for p, r in rows]
    assert ds.num_loss_tokens.tolist() == [sum(_reference(p, r)[1]) for p, r in rows]
    assert ds[-1]["input_ids"].tolist() == _reference(*rows[-1])[0]
    with pytest.raises(IndexError):
        ds[len(rows)]


@pytest.mark.parametrize("truncation", ["left", "right"])
def test_truncated_samples_equal_the_truncated_reference(tmp_path, truncation):
    rows = _rows(200, seed=1)
    max_length = 64
    ds = SFTDataset(
        files=_write_parquet(tmp_path / "d.parquet", rows),
        tokenizer=ByteTokenizer(),
        config=SFTDataConfig(max_length=max_length, truncation=truncation),
    )
    for i, (prompt, response) in enumerate(rows):
        ids, mask = _reference(prompt, response)
        cut = slice(-max_length, None) if truncation == "left" else slice(0, max_length)
        ids, mask = ids[cut], mask[cut]
        mask[0] = 0
        assert ds[i]["input_ids"].tolist() == ids and ds[i]["loss_mask"].tolist() == mask, f"sample {i}"
        assert ds.num_loss_tokens[i] == sum(mask)


def test_store_holds_at_most_6_bytes_per_token(tmp_path):
    """Deterministic count: arrays the dataset keeps, and Python-traced memory retained by the build."""
    rows = _rows(2000, seed=2)
    path = _write_parquet(tmp_path / "d.parquet", rows)
    config = SFTDataConfig(max_length=4096)
    SFTDataset(files=path, tokenizer=ByteTokenizer(), config=config)  # warm lazy imports and caches
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ds = SFTDataset(files=path, tokenizer=ByteTokenizer(), config=config)
        retained = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    num_tokens, num_samples = int(ds.seq_lens.sum()), len(ds)
    # uint16 ids + uint8 mask per token; offsets, loss-token count, file index and row per sample
    assert ds.nbytes == 3 * num_tokens + 8 * (num_samples + 1) + (8 + 4 + 8) * num_samples
    assert ds.nbytes / num_tokens <= 6
    assert retained / num_tokens <= 6, f"{retained / num_tokens:.2f} bytes/token retained"


class _WideVocabTokenizer(ByteTokenizer):
    """Byte tokenizer whose ids are shifted past 65535, so the store needs int32 ids."""

    SHIFT = 70_000

    @property
    def vocab_size(self):
        return self.SHIFT + super().vocab_size

    def apply_chat_template(self, messages, *, add_generation_prompt=False):
        ids = super().apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        return [self.SHIFT + t for t in ids]


def test_ids_beyond_uint16_are_stored_exactly_as_int32(tmp_path):
    rows = _rows(50, seed=3)
    ds = SFTDataset(
        files=_write_parquet(tmp_path / "d.parquet", rows),
        tokenizer=_WideVocabTokenizer(),
        config=SFTDataConfig(max_length=4096),
    )
    for i, (prompt, response) in enumerate(rows):
        ids, mask = _reference(prompt, response)
        assert ds[i]["input_ids"].tolist() == [_WideVocabTokenizer.SHIFT + t for t in ids]
        assert ds[i]["loss_mask"].tolist() == mask
    assert ds.nbytes / int(ds.seq_lens.sum()) <= 6


class _OutOfVocabTokenizer(ByteTokenizer):
    def apply_chat_template(self, messages, *, add_generation_prompt=False):
        ids = super().apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        if messages[0]["content"] == "bad":  # the user turn, in every rendering of the chat
            ids[1] = self.vocab_size
        return ids


def test_token_id_outside_the_vocab_names_file_and_row(tmp_path):
    path = _write_parquet(tmp_path / "d.parquet", [("a", "b"), ("bad", "c")])
    with pytest.raises(DataError, match=r"d\.parquet: row 1: token id 260 is outside the tokenizer's vocab"):
        SFTDataset(files=path, tokenizer=_OutOfVocabTokenizer())


def _collected(loader, num_batches):
    out = []
    while len(out) < num_batches:
        for batch in loader:
            out.append(batch["input_ids"].tolist())
            if len(out) == num_batches:
                break
    return out


def test_resume_from_any_step_on_a_rebuilt_dataset_continues_the_uninterrupted_batches(tmp_path):
    rows = _rows(23, seed=4, max_len=40)
    path = _write_parquet(tmp_path / "d.parquet", rows)

    def loader():
        ds = SFTDataset(files=path, tokenizer=ByteTokenizer())
        return StatefulDataLoader(ds, batch_size=4, collate_fn=ds.collate, seed=5)

    total = 12  # over two epochs of 5 batches
    reference = _collected(loader(), total)
    # the batches hold exactly the reference samples of the sampler's order
    order = [i for e in range(3) for i in np.random.default_rng([5, e]).permutation(23)[:20]]
    first = _reference(*rows[order[0]])[0]
    assert reference[0][0][: len(first)] == first
    for stop in (0, 1, 4, 5, 7, total):
        head_loader = loader()
        head = _collected(head_loader, stop) if stop else []
        state = json.loads(json.dumps(head_loader.state_dict()))  # as a checkpoint stores it
        resumed = loader()  # rebuilt from the files, as a restarted driver does
        resumed.load_state_dict(state)
        tail = _collected(resumed, total - stop) if total - stop else []
        assert head + tail == reference, f"stop={stop}"


def test_resume_on_changed_data_is_refused(tmp_path):
    rows = _rows(10, seed=6, max_len=40)
    path = _write_parquet(tmp_path / "d.parquet", rows)
    ds = SFTDataset(files=path, tokenizer=ByteTokenizer())
    state = StatefulDataLoader(ds, batch_size=2, collate_fn=ds.collate).state_dict()
    same = SFTDataset(files=path, tokenizer=ByteTokenizer())
    StatefulDataLoader(same, batch_size=2, collate_fn=same.collate).load_state_dict(state)  # negative control
    edited = rows[:3] + [(rows[3][0], rows[3][1] + "x")] + rows[4:]  # same row count, one response longer
    changed = SFTDataset(files=_write_parquet(tmp_path / "e.parquet", edited), tokenizer=ByteTokenizer())
    with pytest.raises(DataError, match="the dataset differs from the checkpoint's"):
        StatefulDataLoader(changed, batch_size=2, collate_fn=changed.collate).load_state_dict(state)
    truncated = SFTDataset(files=path, tokenizer=ByteTokenizer(), config=SFTDataConfig(max_length=8, truncation="left"))
    with pytest.raises(DataError, match="fingerprint"):
        StatefulDataLoader(truncated, batch_size=2, collate_fn=truncated.collate).load_state_dict(state)


class _BatchingTokenizer(ByteTokenizer):
    """Byte tokenizer with the optional batch method; records the batch sizes it was called with."""

    def __init__(self):
        self.batch_sizes = []

    def apply_chat_template_batch(self, conversations, *, add_generation_prompt=False):
        self.batch_sizes.append(len(conversations))
        return [self.apply_chat_template(c, add_generation_prompt=add_generation_prompt) for c in conversations]


def test_tokenizer_batch_method_is_used_per_chunk_and_gives_identical_samples(tmp_path):
    rows = _rows(1500, seed=7, max_len=30)
    path = _write_parquet(tmp_path / "d.parquet", rows)
    tokenizer = _BatchingTokenizer()
    batched = SFTDataset(files=path, tokenizer=tokenizer)
    plain = SFTDataset(files=path, tokenizer=ByteTokenizer())
    assert max(tokenizer.batch_sizes) > 1000  # one call per chunk and flag, not per row
    assert len(tokenizer.batch_sizes) == 4
    assert batched.fingerprint() == plain.fingerprint()
    for i in (0, 777, 1499):
        assert batched[i]["input_ids"].tolist() == _reference(*rows[i])[0]


def test_a_failing_batch_falls_back_per_row_and_names_the_row(tmp_path):
    path = str(tmp_path / "u.jsonl")
    with open(path, "w") as f:
        f.write('{"prompt": "a", "response": "b"}\n{"prompt": "x", "response": "y"}\n')

    class _Failing(_BatchingTokenizer):
        def apply_chat_template(self, messages, *, add_generation_prompt=False):
            if messages[0]["content"] == "x":
                raise UnicodeEncodeError("utf-8", "x", 0, 1, "surrogates not allowed")
            return super().apply_chat_template(messages, add_generation_prompt=add_generation_prompt)

    with pytest.raises(DataError, match=r"u\.jsonl: row 1: text is not valid Unicode"):
        SFTDataset(files=path, tokenizer=_Failing())
    ds = SFTDataset(files=path, tokenizer=_Failing(), config=SFTDataConfig(on_malformed="skip"))
    assert len(ds) == 1 and [e.row for e in ds.skipped] == [1]


class _CycleMakingTokenizer(ByteTokenizer):
    """Creates one reference cycle per call, as template engines can; counts the cycles freed so far."""

    def __init__(self):
        self.created = 0
        self.freed = [0]
        self.freed_at_last_call = 0

    def apply_chat_template(self, messages, *, add_generation_prompt=False):
        freed = self.freed

        class Node:
            def __del__(self):
                freed[0] += 1

        node = Node()
        node.self = node
        self.created += 1
        self.freed_at_last_call = freed[0]
        return super().apply_chat_template(messages, add_generation_prompt=add_generation_prompt)


def test_cycles_made_by_the_tokenizer_are_freed_during_the_build(tmp_path):
    """The build pauses automatic GC for speed, but still collects young cycles after every chunk."""
    path = _write_parquet(tmp_path / "d.parquet", _rows(3000, seed=8, max_len=5))
    tokenizer = _CycleMakingTokenizer()
    SFTDataset(files=path, tokenizer=tokenizer)
    assert tokenizer.created == 6000
    assert tokenizer.freed_at_last_call >= 2 * 2 * 1024  # the cycles of the first two chunks
