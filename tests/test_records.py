"""Shared JSON readers: a file too deeply nested to parse is a UserError naming it, never a RecursionError; a
line that is not JSON says what the file most likely is."""

from __future__ import annotations

import re

import pytest

from dflash.errors import UserError
from dflash.records import RecordError, chat_messages, read_json_object, read_jsonl


def test_a_json_file_nested_too_deeply_is_not_what_was_asked_for(tmp_path):
    path = tmp_path / "manifest.json"
    path.write_text("[" * 100000)
    with pytest.raises(UserError, match="manifest.json is not a feature cache manifest; delete it"):
        read_json_object(path, "a feature cache manifest", "delete it")


def test_a_jsonl_line_nested_too_deeply_is_named_by_its_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "fine"}\n' + '{"a": ' * 100000 + "\n")
    with pytest.raises(UserError, match="data.jsonl:2 is nested too deeply to read"):
        read_jsonl(path, missing="unused")


@pytest.mark.parametrize("content, hint", [
    ('{"prompt": "a"}\n{"prompt": "cut sh', "it is the last line and ends without a newline, cut short: if `dflash "
                                           "datagen` wrote the file, it was stopped while writing"),
    ('[\n  {"prompt": "a"},\n  {"prompt": "b"}\n]\n', "the file looks like one JSON array"),
    ("prompt,answer\nhow many?,3\n", "the file looks like CSV"),
    ('{"prompt": "a"}\n{prompt: b}\n', "the file must be JSONL, one JSON object per line"),
])
def test_a_line_that_is_not_json_says_what_the_file_most_likely_is(tmp_path, content, hint):
    path = tmp_path / "data.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match="is not valid JSON") as caught:
        read_jsonl(path, missing="unused")
    assert hint in str(caught.value)


def test_a_line_cut_short_before_the_last_says_where_json_found_it_broken(tmp_path):
    """json's message for a string running into the line's end read "(Invalid control character at)": the
    newline, and a position json leaves out of its message."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a"}\n{"id": 9, "respo\n{"prompt": "b"}\n')
    with pytest.raises(UserError, match=r"data.jsonl:2 is not valid JSON \(Unterminated string starting at column "
                                        r"11\); the file must be JSONL"):
        read_jsonl(path, missing="unused")


SHAREGPT = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "How many?"},
                              {"from": "gpt", "value": "72."}, {"from": "Human", "value": "And May?"}]}
AS_MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many?"},
               {"role": "assistant", "content": "72."}, {"role": "user", "content": "And May?"}]


def test_sharegpt_conversations_read_as_chat_messages():
    """ShareGPT's form, the common one for drafter training prompts, besides `messages`."""
    assert chat_messages(SHAREGPT) == AS_MESSAGES == chat_messages({"messages": AS_MESSAGES})
    assert chat_messages({"conversations": AS_MESSAGES}) == AS_MESSAGES  # role/content under `conversations`
    for value, message in ((["hi"], '`conversations`[0] needs a string "from" and a string "value"'),
                           ([{"from": "tool", "value": "x"}], "`conversations`[0] is from 'tool'; ShareGPT speakers"),
                           ([], "`conversations` must be a non-empty list")):
        with pytest.raises(RecordError, match=re.escape(message)):
            chat_messages({"conversations": value})
    with pytest.raises(RecordError, match="has both `messages` and `conversations`"):
        chat_messages({"messages": AS_MESSAGES, **SHAREGPT})
