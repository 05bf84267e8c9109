"""Answers read as tool calls: Hermes' blocks (tool_choice auto), a required answer's JSON array, a named function's
arguments; a stream sends the content as it comes and the calls whole at the end, adding up to the whole answer's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dflash.serve.tools import ToolReader, calls_schema, hermes_calls, json_calls, writes_hermes_calls

WEATHER = '{"name": "weather", "arguments": {"city": "Paris", "days": 2}}'
TIME = '{"name": "time", "arguments": {"zone": "CET"}}'


def calls_of(read) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in read]


@pytest.mark.parametrize("text, content, calls", [
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None, [("weather", {"city": "Paris", "days": 2})]),
    (f"Let me look.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n", "Let me look.\n",
     [("weather", {"city": "Paris", "days": 2}), ("time", {"zone": "CET"})]),
    (f"<tool_call>{WEATHER}", None, [("weather", {"city": "Paris", "days": 2})]),  # cut before its closing tag
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', None, [("f", {"x": 1})]),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
    (f"<tool_call>{WEATHER}</tool_call>\n\nI asked for the weather.", None,  # text after the calls: dropped
     [("weather", {"city": "Paris", "days": 2})]),
])
def test_hermes_blocks_are_calls(text, content, calls):
    read = hermes_calls(text)
    assert read is not None and read[0] == content and calls_of(read[1]) == calls
    assert len({c.id for c in read[1]}) == len(calls) and all(c.id.startswith("call_") for c in read[1])


@pytest.mark.parametrize("text", [
    "no call here", f"<tool_call>{WEATHER[:-3]}</tool_call>", "<tool_call>[1, 2]</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',  # NaN, Infinity and 1e400: no JSON to send on
    '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>',
])
def test_what_is_not_a_hermes_call_is_text(text):
    assert hermes_calls(text) is None
    assert ToolReader("auto").read(text) == (text, [])


def test_a_required_answer_is_a_json_array_of_calls():
    assert calls_of(json_calls(f"[{WEATHER}, {TIME}]")) == [("weather", {"city": "Paris", "days": 2}),
                                                           ("time", {"zone": "CET"})]
    assert json_calls(f"[{WEATHER}") is None and json_calls("[]") is None and json_calls(WEATHER) is None
    assert calls_of(ToolReader("required", parallel=False).read(f"[{WEATHER}, {TIME}]")[1]) == [
        ("weather", {"city": "Paris", "days": 2})]
    named = ToolReader("named", name="weather").read('{"city": "Rome"}')
    assert named[0] is None and calls_of(named[1]) == [("weather", {"city": "Rome"})]
    assert ToolReader("named", name="weather").read('{"city": "Ro') == ('{"city": "Ro', [])
    assert ToolReader("named", name="weather").read('{"x": 1e400}') == ('{"x": 1e400}', [])


def test_the_required_schema_names_each_tool_with_its_parameters():
    tools = [{"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
             {"name": "time"}]
    schema = calls_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1 and "maxItems" not in calls_schema(tools, True)
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"const": "weather"}
    assert first["properties"]["arguments"] == {"$ref": "#/$defs/tool0"} and schema["$defs"]["tool0"] == tools[0][
        "parameters"]
    assert schema["$defs"]["tool1"] == {"type": "object"}


def test_a_tools_own_references_follow_it_into_the_required_schema():
    """pydantic's nested models ($defs) and recursion ("#") mean what they meant at the tool's own root (helper-124:
    '#/$defs/Place' pointed at the array's root, which has no such key)."""
    place = {"type": "object", "properties": {"city": {"type": "string"}}}
    book = {"$defs": {"Place": place}, "type": "object",
            "properties": {"where": {"$ref": "#/$defs/Place"}, "then": {"$ref": "#"}, "web": {"$ref": "https://x/y"}}}
    rebased = calls_schema([{"name": "other"}, {"name": "book", "parameters": book}], True)["$defs"]["tool1"]
    assert rebased["properties"] == {"where": {"$ref": "#/$defs/tool1/$defs/Place"}, "then": {"$ref": "#/$defs/tool1"},
                                     "web": {"$ref": "https://x/y"}}
    assert rebased["$defs"] == {"Place": place}


@pytest.mark.parametrize("mode", ["none", "auto", "required", "named"])
@pytest.mark.parametrize("text", [
    f"Let me look.<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>",
    "A plain answer with <tool and <tool_call but no call",
    f"[{WEATHER}]", '{"city": "Rome"}', f"<tool_call>{WEATHER[:-5]}",
    f"<<tool_call>{TIME}</tool_call> and words after the call", f"Calls: <tool_call>{TIME}</tool_call> <tool_",
])
@pytest.mark.parametrize("size", [1, 3, 50])
def test_a_stream_adds_up_to_the_whole_answers_content_and_calls(mode, text, size):
    reader = ToolReader(mode, name="weather")
    stream = reader.stream()
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    sent_before = "".join(stream.add(piece) for piece in pieces[:-1])
    rest, calls = stream.finish(pieces[-1])
    content, whole_calls = reader.read(text)
    assert sent_before + rest == (content or "")
    assert calls_of(calls) == calls_of(whole_calls)
    if mode == "auto" and whole_calls:
        assert "<tool_call" not in sent_before  # nothing of a block went out as text
    if mode in ("required", "named"):
        assert sent_before == ""  # held until the end: all of it may be calls
    if mode == "none":
        assert stream.parts == []  # without tools nothing is kept


@pytest.mark.parametrize("template, specials, why", [
    ("...<tool_call>\n{{ call | tojson }}\n</tool_call>...", [], None),
    ("...[TOOL_CALLS]...", [], "teaches another form"),
    ("<tool_call>\n<function={{ name }}>\n<parameter=...", [], "Qwen3-Coder"),
    ("...<tool_call>{{ call | tojson }}</tool_call>", ["<tool_call>"], "special token"),
])
def test_auto_reads_the_models_that_write_hermes_json(template, specials, why):
    tokenizer = SimpleNamespace(chat_template=template, all_special_tokens=specials)
    said = writes_hermes_calls(tokenizer)
    assert said is None if why is None else why in said
