"""Property: multi-turn chats, any truncation, stored compactly == the byte format written out by hand."""

import json
import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from verl_balance.data import ByteTokenizer, SFTDataConfig, SFTDataset

BOS, SEP, EOS = ByteTokenizer.BOS, ByteTokenizer.SEP, ByteTokenizer.EOS
NEWLINE = ord("\n")

text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
message = st.tuples(st.sampled_from(["system", "user", "assistant"]), text)
chat = st.lists(message, min_size=1, max_size=6).filter(
    lambda messages: (
        any(role == "assistant" and content for role, content in messages)
        and all(content for role, content in messages if role == "assistant")
    )
)


def _reference(messages):
    """[BOS], non-assistant turns joined by "\\n", each assistant turn [SEP] content [EOS]; targets: content + EOS."""
    ids, mask, previous = [BOS], [0], None
    for role, content in messages:
        body = list(content.encode())
        if role == "assistant":
            ids += [SEP, *body, EOS]
            mask += [0] + [1] * (len(body) + 1)
        else:
            if previous is not None and previous != "assistant":
                ids.append(NEWLINE)
                mask.append(0)
            ids += body
            mask += [0] * len(body)
        previous = role
    return ids, mask


@settings(max_examples=25, deadline=None)
@given(
    chats=st.lists(chat, min_size=1, max_size=12),
    max_length=st.integers(2, 40),
    truncation=st.sampled_from(["left", "right"]),
)
def test_stored_chats_equal_the_hand_written_format_after_truncation(chats, max_length, truncation):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chats.jsonl")
        with open(path, "w") as f:
            for messages in chats:
                f.write(json.dumps({"messages": [{"role": r, "content": c} for r, c in messages]}) + "\n")
        ds = SFTDataset(
            files=path,
            tokenizer=ByteTokenizer(),
            config=SFTDataConfig(messages_key="messages", max_length=max_length, truncation=truncation),
        )
        assert len(ds) == len(chats)
        for i, messages in enumerate(chats):
            ids, mask = _reference(messages)
            if len(ids) > max_length:
                cut = slice(len(ids) - max_length, None) if truncation == "left" else slice(0, max_length)
                ids, mask = ids[cut], mask[cut]
            mask[0] = 0
            assert ds[i]["input_ids"].tolist() == ids, f"chat {i}"
            assert ds[i]["loss_mask"].tolist() == mask, f"chat {i}"
            assert ds.seq_lens[i] == len(ids) and ds.num_loss_tokens[i] == sum(mask)
            assert ds.origin(i) == (path, i)
