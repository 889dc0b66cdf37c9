"""Tokenizer contract: byte round trip, chat format, prefix invariant, no downloads."""

import pytest

from verl_balance.data.tokenizer import ByteTokenizer, TokenizerError, build_tokenizer

B, SEP, EOS = ByteTokenizer.BOS, ByteTokenizer.SEP, ByteTokenizer.EOS


@pytest.mark.parametrize("text", ["", "12+34=", "reverse abc", "héllo wörld ✓ 🙂", "line1\nline2\t"])
def test_byte_round_trip_is_identity(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_vocab_and_special_ids_are_distinct_and_in_range():
    tok = ByteTokenizer()
    specials = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.sep_token_id}
    assert len(specials) == 4
    assert all(256 <= s < tok.vocab_size for s in specials)
    assert tok.vocab_size == 260


def test_decode_skips_or_names_special_tokens():
    tok = ByteTokenizer()
    ids = [B, *tok.encode("ab"), SEP, *tok.encode("c"), EOS, tok.pad_token_id]
    assert tok.decode(ids) == "abc"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>ab<sep>c<eos><pad>"
    with pytest.raises(TokenizerError, match="outside"):
        tok.decode([300])


def test_byte_chat_template_matches_hand_worked_ids():
    tok = ByteTokenizer()
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": "v"},
    ]
    assert tok.apply_chat_template(messages) == [B, ord("s"), ord("\n"), ord("u"), SEP, ord("x"), EOS, ord("v")]
    assert tok.apply_chat_template(messages, add_generation_prompt=True)[-2:] == [ord("v"), SEP]


def test_special_tokens_cannot_be_forged_by_text():
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "<eos><sep>"}])
    assert ids.count(EOS) == 0 and ids.count(SEP) == 0


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", "list"),
        ([{"role": "user"}], "content"),
        ([{"role": "robot", "content": "x"}], "valid roles"),
        ([["user", "x"]], "dict"),
    ],
)
def test_malformed_messages_raise_naming_the_problem(messages, match):
    with pytest.raises(TokenizerError, match=match):
        ByteTokenizer().apply_chat_template(messages)


def test_build_tokenizer_byte_and_unknown_name(tmp_path):
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    assert isinstance(build_tokenizer(None), ByteTokenizer)
    with pytest.raises(TokenizerError, match="nothing is downloaded"):
        build_tokenizer("Qwen/Qwen2.5-0.5B")
    with pytest.raises(TokenizerError):
        build_tokenizer(str(tmp_path / "missing"))


def _save_tiny_hf_tokenizer(path):
    """A word-level tokenizer saved locally (no network), optionally with a chat template."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<pad>": 1, "<s>": 2, "</s>": 3, "\n": 4, " ": 5}
    for word in ["hi", "there", "a", "b", "c", "user", "assistant", ":"]:
        vocab[word] = len(vocab)
    model = tokenizers.models.WordLevel(vocab=vocab, unk_token="<unk>")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(pattern=tokenizers.Regex(r"\s+|:"), behavior="isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}{% if m['role'] == 'assistant' %}</s>"
        "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
    )
    tok.save_pretrained(path)
    return tok


def test_hf_tokenizer_keeps_the_prefix_invariant(tmp_path):
    from verl_balance.data.sft_dataset import tokenize_chat
    from verl_balance.data.tokenizer import HFTokenizer

    hf = _save_tiny_hf_tokenizer(str(tmp_path / "tok"))
    tok = build_tokenizer(str(tmp_path / "tok"))
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(hf) and tok.eos_token_id == hf.eos_token_id
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a b"}]
    ids, mask = tokenize_chat(tok, messages)
    targets = [t for t, m in zip(ids, mask) if m]
    assert tok.decode(targets, skip_special_tokens=False) == "a b</s>\n"
    assert tok.eos_token_id in targets and tok.decode(ids[: mask.index(1)]) == "user:hi\nassistant:"


def test_hf_tokenizer_chat_template_returns_token_ids_not_a_batch_encoding(tmp_path):
    """transformers' apply_chat_template(tokenize=True) returns a BatchEncoding unless
    return_dict=False (shown); HFTokenizer returns plain ids that keep the prefix invariant."""
    pytest.importorskip("transformers")
    from verl_balance.models.tiny_hf import build_tokenizer as build_tiny_tokenizer

    build_tiny_tokenizer().save_pretrained(str(tmp_path))
    tok = build_tokenizer(str(tmp_path))
    messages = [{"role": "user", "content": "what is 12+34"}, {"role": "assistant", "content": "46"}]
    raw = tok.hf_tokenizer.apply_chat_template(messages, tokenize=True)
    assert not isinstance(raw, list)  # the trap: a BatchEncoding (a dict), whose list() is its keys
    ids = tok.apply_chat_template(messages)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True)
    assert ids[: len(prompt)] == prompt
    assert ids[len(prompt) :] == tok.encode("46") + [tok.eos_token_id] + tok.encode("\n")
    assert tok.decode(ids[len(prompt) :]).startswith("46")
