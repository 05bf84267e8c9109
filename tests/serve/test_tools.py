"""Tool calls through the server, with the official openai client: tools reach the chat template; a required or
named tool_choice holds the answer to a call (a grammar: drafting stays lossless) returned as `tool_calls`, whole
or streamed; earlier calls and tool results render in the conversation; what cannot work is a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import byte_fallback_tokenizer, save_tiny_pair
from dflash.decoding import GenerationConfig, SpeculativeEngine
from dflash.serve.tools import arguments_schema

from .conftest import MODEL, serving

pytest.importorskip("llguidance")

# A Hermes-style template of our own: the tools in the system turn, each earlier call as a <tool_call> block, each
# result as a tool turn.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Functions you may call:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if not (tools and loop.first and m.role == 'system') %}<|im_start|>{{ m.role }}\n"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% for call in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC"]}},
                                   "required": ["zone"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A server whose tokenizer writes any character and whose chat template renders tools."""
    tokenizer = byte_fallback_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    with serving(save_tiny_pair(tmp_path_factory.mktemp("tools_pair"), tokenizer=tokenizer)) as server:
        yield server


def chat(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def streamed_chunks(server, **fields) -> list[dict]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0, "stream": True, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


def check_weather(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "weather"
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 9 and set(arguments) == {"city", "days"}
    return arguments


def test_tools_reach_the_chat_template(tool_server):
    pipe = tool_server.pipe
    shown = pipe.tokenizer.decode(pipe.encode(MESSAGES, tools=[WEATHER]))
    assert '"name": "weather"' in shown and '"description": "The weather in a city"' in shown
    plain = chat(tool_server, max_tokens=4).json()["usage"]["prompt_tokens"]
    with_tools = chat(tool_server, max_tokens=4, tools=[WEATHER], tool_choice="none").json()
    assert with_tools["usage"]["prompt_tokens"] == len(pipe.encode(MESSAGES, tools=[WEATHER])) > plain
    assert "tool_calls" not in with_tools["choices"][0]["message"]  # "none": the answer is text


def test_a_required_tool_choice_answers_with_calls(tool_server):
    client = tool_server.client()
    for parallel in (True, False):
        out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                             tools=[WEATHER, TIME], tool_choice="required",
                                             parallel_tool_calls=parallel)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            if call.function.name == "weather":
                check_weather(call)
            else:
                assert call.function.name == "time" and json.loads(call.function.arguments)["zone"] in ("CET", "UTC")


def test_a_named_tool_choice_answers_with_its_arguments_as_the_target_alone_decodes_them(tool_server):
    """The call's arguments are what the target alone writes under the function's schema (the grammar the server
    builds): drafting changed nothing."""
    client = tool_server.client()
    named = {"type": "function", "function": {"name": "weather"}}
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                         tools=[TIME, WEATHER], tool_choice=named)
    [call] = out.choices[0].message.tool_calls
    arguments = check_weather(call)
    pipe = tool_server.pipe
    ids = pipe.encode(MESSAGES, tools=[TIME, WEATHER])
    config = GenerationConfig(max_new_tokens=60, json_schema=arguments_schema(WEATHER["function"]))
    alone = SpeculativeEngine(pipe.target).generate([ids], config)[0]
    assert json.loads(pipe.tokenizer.decode(alone.output_ids, skip_special_tokens=True)) == arguments


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_streamed_calls_are_the_whole_answers(tool_server, tool_choice):
    whole = chat(tool_server, tools=[WEATHER], tool_choice=tool_choice).json()["choices"][0]
    chunks = streamed_chunks(tool_server, tools=[WEATHER], tool_choice=tool_choice)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (i, c["function"]["name"], json.loads(c["function"]["arguments"]))
        for i, c in enumerate(whole["message"]["tool_calls"])]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert deltas[0] == {"role": "assistant", "content": None}  # an answer of calls alone opens with null content
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"


def test_a_required_call_of_a_pydantic_tool_with_nested_models_keeps_their_schema(tool_server):
    """openai.pydantic_function_tool writes nested models as $defs: the required grammar reads them where the tool
    put them (helper-124: a 400 'Pointer /$defs/Place does not exist'), and a named function's name may hold dots."""
    pydantic = pytest.importorskip("pydantic")
    import openai

    class Place(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)

    class Book(pydantic.BaseModel):
        where: Place
        nights: int = pydantic.Field(ge=1, le=9)

    tool = openai.pydantic_function_tool(Book, name="hotel.book")
    assert "$defs" in tool["function"]["parameters"]
    out = tool_server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0,
                                                       tools=[tool], tool_choice="required")
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "hotel.book"
    Book.model_validate_json(call.function.arguments)  # the nested model's fields, as the schema says


def test_auto_answers_text_when_the_model_writes_no_call_streamed_or_not(tool_server):
    """The tiny random model writes no <tool_call> block: the answer is its text, as without tools."""
    whole = chat(tool_server, tools=[WEATHER]).json()["choices"][0]
    assert "tool_calls" not in whole["message"] and whole["finish_reason"] in ("stop", "length")
    chunks = streamed_chunks(tool_server, tools=[WEATHER])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == whole["message"]["content"] and text


def test_earlier_calls_and_their_results_render_in_the_conversation(tool_server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                              "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = chat(tool_server, messages=history, tools=[WEATHER], max_tokens=4)
    assert response.status_code == 200, response.text
    rendered = tool_server.pipe.tokenizer.decode(tool_server.pipe.encode(
        [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                              for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in history],
        tools=[WEATHER]))
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>' in rendered
    assert response.json()["usage"]["prompt_tokens"] == len(tool_server.pipe.encode(
        [history[0], {**history[1], "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": {"city": "Paris", "days": 2}}}]}, history[2]], tools=[WEATHER]))


@pytest.mark.parametrize("fields, param, says", [
    (dict(tool_choice="required"), "tool_choice", "the request has no tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "time"}}), "tool_choice",
     "not among the tools ('weather')"),
    (dict(tools=[WEATHER, WEATHER]), "tools", "'weather' more than once"),
    (dict(tools=[{"type": "retrieval"}]), "tools.0.type", "function"),
    (dict(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools.0.function.name",
     "is not a function name"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice", '"none", "auto", "required"'),
    (dict(tools=[WEATHER], tool_choice="required", guided_regex="a+"), "guided_regex",
     "tool_choice \"required\" and guided_regex each set the answer's structure"),
    (dict(tools=[WEATHER], tool_choice="required", min_tokens=3), "min_tokens", "min_tokens with tool_choice"),
    (dict(messages=MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "weather", "arguments": "{city"}}]}]),
     "messages.1.tool_calls.0.function.arguments", "must be JSON text of an object"),
    (dict(functions=[{"name": "weather"}]), "functions", "send tools"),
    (dict(tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "foo"}}}}}], tool_choice="required"),
     "tools.1.function.parameters", "these parameters cannot hold a call"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools.0.function.parameters", "must be the JSON schema of an object"),
    (dict(tools=[WEATHER], tool_choice="required", add_generation_prompt=False, continue_final_message=True,
          messages=MESSAGES + [{"role": "assistant", "content": "[{"}]), "tool_choice", "continue_final_message"),
])
def test_tool_requests_that_cannot_work_are_400s_naming_the_field(tool_server, fields, param, says):
    response = chat(tool_server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_a_template_without_tools_is_a_400(server, tool_choice):
    """The shared server's ChatML template never shows tools: said so, whatever the tool choice."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "tools": [WEATHER], "tool_choice": tool_choice}
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools"
    assert "never shows the model tools" in refused.json()["error"]["message"]


def test_auto_is_refused_where_the_template_writes_calls_in_another_form(tmp_path):
    tokenizer = byte_fallback_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE.replace("<tool_call>", "[CALL]").replace("</tool_call>", "[/CALL]")
    with serving(save_tiny_pair(tmp_path, tokenizer=tokenizer)) as server:
        refused = chat(server, tools=[WEATHER])
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"
        assert "Hermes" in refused.json()["error"]["message"]
        named = chat(server, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "weather"}})
        assert named.status_code == 200 and named.json()["choices"][0]["message"]["tool_calls"]
