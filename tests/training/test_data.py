"""Reading training records: every mistake is an error naming the file and line, never a traceback."""

from __future__ import annotations

import copy
import json
import re

import pytest

from dflash.errors import UserError
from dflash.training.data import fingerprint, read_examples


@pytest.fixture(scope="module")
def tokenizer():
    from conftest import make_tokenizer

    return make_tokenizer()


GOOD = {"id": 0, "messages": [], "prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 11]}


@pytest.mark.parametrize("record, message", [
    (5, "is 5, not a JSON object"),
    ({"messages": "hi", "response": "x"}, "`messages` must be a non-empty list"),
    ({"prompt": 5, "response": "x"}, "`prompt` must be a non-empty string, got 5"),
    ({"prompt": "q", "response": ["x"]}, "`response` must be a non-empty string"),
    ({"turns": "q", "response": "x"}, "`turns` must be a list of strings"),
    ({"turns": ["q", "and then?"], "response": "x"}, "this record has 2 `turns` and one `response`"),
    ({"prompt": "q"}, "needs `messages` (ending with the assistant turn) or a `response`"),
    ({"messages": [{"role": "user", "content": "q"}]}, "last message of a training record must be the assistant"),
    ({"prompt_ids": [5, 6], "response_ids": "abc"}, "`response_ids` must be a list of token ids"),
    ({"prompt_ids": [5, True], "response_ids": [7, 8]}, "`prompt_ids` must be a list of token ids"),
    ({"prompt_ids": [5, 6], "response_ids": [7, 5000]},
     "`response_ids` holds ids outside the target's vocabulary of 128 (e.g. 5000): this data was made with another "
     "target"),
    ('{"prompt": ' + "[" * 100000, "is nested too deeply to read"),
])
def test_bad_training_records_are_named_with_their_line(tmp_path, tokenizer, record, message):
    path = tmp_path / "data.jsonl"
    line = record if isinstance(record, str) else json.dumps(record)
    path.write_text(json.dumps(GOOD) + "\n\n" + line + "\n")
    with pytest.raises(UserError, match=re.escape("data.jsonl:3") + ".*" + re.escape(message)):
        read_examples(path, tokenizer, max_length=64, vocab_size=128)


def test_text_records_need_a_chat_template(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "How many clips?", "response": "The answer is 72."}) + "\n")
    assert read_examples(path, tokenizer, max_length=64).examples  # with the template: fine
    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    with pytest.raises(UserError, match="data.jsonl:1: this record is text, and the target's tokenizer has no chat "
                                        "template"):
        read_examples(path, base, max_length=64)


def test_a_chat_template_that_refuses_a_record_is_quoted_with_the_line(tmp_path, tokenizer):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start "
                            "with a user message') }}{% endif %}" + tokenizer.chat_template)
    path = tmp_path / "data.jsonl"
    good = {"prompt": "How many clips?", "response": "72"}
    bad = {"messages": [{"role": "assistant", "content": "hi"}, {"role": "assistant", "content": "72"}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(UserError, match=re.escape("data.jsonl:2: the model's chat template refused these messages: "
                                                  "Conversations must start with a user message")):
        read_examples(path, strict, max_length=64)


def test_a_file_that_is_not_utf8_is_named(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(UserError, match="data.jsonl:2 is not UTF-8"):
        read_examples(path, tokenizer, max_length=64)


def test_the_fingerprint_follows_the_tokens_and_their_order(tokenizer, tmp_path):
    path = tmp_path / "data.jsonl"
    other = dict(GOOD, response_ids=[8, 9, 10, 12])
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(other) + "\n")
    examples = read_examples(path, tokenizer, max_length=64).examples
    assert fingerprint(examples) == fingerprint(read_examples(path, tokenizer, max_length=64).examples)
    assert fingerprint(examples) != fingerprint(examples[::-1])
    assert fingerprint(examples) != fingerprint(read_examples(path, tokenizer, max_length=6).examples)
