"""Chat templating + loss masks on the real SmolLM2 tokenizer, and token-budget batches."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from dflash_train.data.chat import ConversationError, tokenize_conversation
from dflash_train.data.dataset import load_dataset, plan_batches


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def supervised_text(tok, t):
    return tok.decode(t.input_ids[t.loss_mask.astype(bool)])


def test_only_assistant_turns_are_supervised_multi_turn_with_system(tok):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green, obviously."},
    ]
    t = tokenize_conversation(tok, msgs, max_length=4096)
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert tok.decode(t.input_ids) == full
    assert supervised_text(tok, t) == "Blue.<|im_end|>\nGreen, obviously.<|im_end|>\n"
    # Every supervised run starts right after "<|im_start|>assistant\n".
    starts = np.flatnonzero(np.diff(np.concatenate([[0], t.loss_mask])) == 1)
    for s in starts:
        assert tok.decode(t.input_ids[max(0, s - 3):s]).endswith("assistant\n")


def test_default_system_prompt_of_the_template_is_not_supervised(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    t = tokenize_conversation(tok, msgs, max_length=4096)
    assert "SmolLM" in tok.decode(t.input_ids)  # the template inserts its own system turn
    assert supervised_text(tok, t) == "Hello there.<|im_end|>\n"


def test_truncation_keeps_masks_aligned(tok):
    msgs = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(map(str, range(500)))}]
    t = tokenize_conversation(tok, msgs, max_length=64)
    assert len(t.input_ids) == len(t.loss_mask) == 64 and t.loss_mask[-1] == 1


@pytest.mark.parametrize("msgs,reason", [
    ([], "non-empty list"),
    ([{"role": "user", "content": "hi"}], "no assistant turn"),
    ([{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}], "role 'bot'"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}], "empty"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}], "non-string"),
    ("hello", "non-empty list"),
])
def test_bad_conversations_say_why(tok, msgs, reason):
    with pytest.raises(ConversationError, match=reason):
        tokenize_conversation(tok, msgs, max_length=128)


def test_dataset_keeps_good_rows_and_reports_bad_ones_by_line(tok, tmp_path, caplog):
    rows = [
        json.dumps({"messages": [{"role": "user", "content": "Say many words."},
                                 {"role": "assistant", "content": "word " * 40}]}),
        "{not json",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "user", "content": "Short?"}, {"role": "assistant", "content": "Yes."}]}),
        json.dumps({"messages": [{"role": "user", "content": "More."}, {"role": "assistant", "content": "more " * 50}]}),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(rows) + "\n")
    with caplog.at_level("WARNING"):
        ds = load_dataset([str(path)], tok, max_length=512, block_size=8)
    assert len(ds) == 2
    assert sum(ds.rejected.values()) == 3
    assert f"{path}:2" in caplog.text and f"{path}:3" in caplog.text


@pytest.mark.parametrize("seed", range(5))
def test_batches_respect_both_limits_and_cover_every_row_once(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(10, 500, size=300)
    batches = plan_batches(lengths, token_budget=1500, max_batch_size=8, seed=seed, epoch=0)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(300))
    for b in batches:
        assert len(b) <= 8 and max(lengths[b]) * len(b) <= 1500
    padding = sum(max(lengths[b]) * len(b) - lengths[b].sum() for b in batches) / sum(max(lengths[b]) * len(b) for b in batches)
    assert padding < 0.1  # length grouping keeps padding low
    assert plan_batches(lengths, 1500, 8, seed, 0) == batches
    assert plan_batches(lengths, 1500, 8, seed, 1) != batches
