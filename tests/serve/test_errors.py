"""Every client mistake is a 4xx with an OpenAI error object that says what the field must be, and the server
keeps serving after it. Options it cannot honour are refused by name, never silently ignored."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

MODEL = "tiny"  # the served model name the fixtures use
MESSAGES = [{"role": "user", "content": "hello"}]


def post(server, path: str, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{path}", timeout=30, **kw)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Value error" not in error["message"]  # pydantic's wording stays out of what clients read
    if param is not None:
        assert error["param"] == param
    return error


NAN_TEMPERATURE = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
DEEP = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("body", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"', NAN_TEMPERATURE, DEEP])
def test_invalid_json_is_400(server, body):
    assert_error(post(server, "chat/completions", content=body, headers={"content-type": "application/json"}), 400)


def test_a_body_nested_too_deeply_says_so(server):
    error = assert_error(post(server, "completions", content=DEEP, headers={"content-type": "application/json"}), 400)
    assert "nested too deeply" in error["message"]


def test_ignored_fields_are_answered_and_logged(server, caplog):
    with caplog.at_level("WARNING", logger="dflash.serve"):
        response = post(server, "chat/completions", json={
            "messages": [{"role": "user", "content": "hello", "nmae": "x", "name": "ok"},
                         {"role": "assistant", "content": "hi"},
                         {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}],
            "max_token": 2, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": False, "inclde": True}})
    assert response.status_code == 200
    # a message's `name` is OpenAI's own field: no warning
    assert ("request fields this server ignores: 'max_token', 'messages[0].nmae', "
            "'messages[2].content[0].cache_control', 'stream_options.inclde'" in caplog.text)


def test_ignored_field_names_cannot_forge_or_flood_a_log_line(server, caplog):
    forged = "a\n2026-12-05 10:00:00,000 ERROR dflash.serve: forged"
    many = {f"field{i:03d}" + "y" * 100: 1 for i in range(50)}
    with caplog.at_level("WARNING", logger="dflash.serve"):
        response = post(server, "chat/completions", json={"messages": MESSAGES, "max_tokens": 1, forged: 1, **many})
    assert response.status_code == 200
    logged = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert len(logged) == 1 and "\n" not in logged[0] and "\\n2026" in logged[0]
    assert "and 31 more" in logged[0] and len(logged[0]) < 2000


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_a_body_not_declared_as_json_is_415(server, content_type):
    """What a browser posts to any site without a CORS preflight (an untyped body too: fetch with no-cors and a
    byte buffer): taking it as JSON would let any web page use a server that has no API key."""
    body = json.dumps({"messages": MESSAGES, "max_tokens": 1}).encode()
    request = httpx.Request("POST", f"{server.url}/v1/chat/completions", content=body,
                            headers={} if content_type is None else {"content-type": content_type})
    assert request.headers.get("content-type") == content_type  # httpx adds none for bytes
    with httpx.Client(timeout=30) as client:
        error = assert_error(client.send(request), 415)
    assert "Content-Type: application/json" in error["message"]


@pytest.mark.parametrize("headers", [{"content-type": "application/json; charset=utf-8"},
                                     {"content-type": "application/vnd.api+json"}])
def test_json_bodies_are_read_whatever_their_parameters(server, headers):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    assert post(server, "completions", content=body, headers=headers).status_code == 200


def test_a_request_body_is_parsed_off_the_event_loop(server, monkeypatch):
    """A body of megabytes takes a second to parse: on the event loop it would stall /health and every stream."""
    import threading

    import dflash.serve.app as app

    threads = []
    parse = app.parse_request

    def spy(raw, model):
        threads.append(threading.current_thread())
        return parse(raw, model)

    monkeypatch.setattr(app, "parse_request", spy)
    assert post(server, "chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).status_code == 200
    assert len(threads) == 1 and threads[0] is not server._thread  # the thread uvicorn runs the event loop on


def test_a_prompt_of_token_ids_is_checked_off_the_event_loop(server, monkeypatch):
    import threading

    import dflash.serve.app as app

    threads = []
    check = app.check_token_ids

    def spy(ids, vocab_size, what="prompt token ids"):
        if what == "prompt token ids":
            threads.append(threading.current_thread())
        return check(ids, vocab_size, what)

    monkeypatch.setattr(app, "check_token_ids", spy)
    assert post(server, "completions", json={"prompt": [5, 6, 7], "max_tokens": 1}).status_code == 200
    assert len(threads) == 1 and threads[0] is not server._thread


@pytest.mark.parametrize("path", ["/health", "/v1/models", f"/v1/models/{MODEL}", "/metrics"])
def test_every_get_route_answers_head_requests_too(server, path):
    response = httpx.head(f"{server.url}{path}")
    assert response.status_code == 200 and response.content == b""


@pytest.mark.parametrize("encoding", ["gzip", "br"])
def test_a_compressed_body_is_415_saying_to_send_it_uncompressed(server, encoding):
    """A gzip body was read as text and answered 'not valid JSON: utf-8 codec can't decode byte 0x8b'."""
    import gzip

    body = gzip.compress(json.dumps({"messages": MESSAGES, "max_tokens": 1}).encode())
    error = assert_error(post(server, "chat/completions", content=body, headers={
        "content-type": "application/json", "content-encoding": encoding}), 415)
    assert f"Content-Encoding '{encoding}'" in error["message"] and "send it uncompressed" in error["message"]
    plain = json.dumps({"messages": MESSAGES, "max_tokens": 1}).encode()
    assert post(server, "chat/completions", content=plain, headers={
        "content-type": "application/json", "content-encoding": "identity"}).status_code == 200


def test_a_client_that_leaves_mid_body_is_no_server_error(server, caplog):
    """A client that declared more body than it sent, then closed, was logged as an unexpected server error with
    a traceback (starlette's ClientDisconnect)."""
    import socket

    with caplog.at_level("INFO", logger="dflash.serve"):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any("disconnected" in r.getMessage() for r in caplog.records):
            time.sleep(0.05)
    messages = [r.getMessage() for r in caplog.records]
    assert any("disconnected before sending its whole request body" in m for m in messages), messages
    assert not any(r.levelname == "ERROR" for r in caplog.records), messages
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_template_switch_that_is_not_a_boolean_is_400(server):
    error = assert_error(post(server, "chat/completions", json={
        "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": "maybe"}}), 400,
        "chat_template_kwargs")
    assert "enable_thinking must be true or false, got 'maybe'" in error["message"]


def test_token_ids_outside_the_vocabulary_name_the_prompt(server):
    error = assert_error(post(server, "completions", json={"model": MODEL, "prompt": [10**6]}), 400, "prompt")
    assert "vocabulary" in error["message"]


def test_a_conversation_the_chat_template_refuses_is_400(server, monkeypatch):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('No user query found') }}{% endif %}x"
    monkeypatch.setattr(server.pipe.tokenizer, "chat_template", template)
    body = {"messages": [{"role": "assistant", "content": "hi"}]}
    error = assert_error(post(server, "chat/completions", json=body), 400, "messages")
    assert "chat template refused these messages: No user query found" in error["message"]


def test_a_user_error_from_deep_in_the_engine_is_400_and_the_server_goes_on(server, client, monkeypatch):
    """The engine refuses some requests only as it sets them up (a GenerationError, a UserError): the handler for
    every UserError answers 400 with its message, not 500."""
    from dflash.errors import GenerationError

    def refuse(*args, **kwargs):
        raise GenerationError("this request asks for something the engine refuses")

    with monkeypatch.context() as patch:
        patch.setattr(server.pipe.engine, "new_sequence", refuse)
        error = assert_error(post(server, "chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}),
                             400)
    assert error["message"] == "this request asks for something the engine refuses"
    assert error["type"] == "invalid_request_error"
    assert chat_answers(client)


def chat_answers(client) -> bool:
    """Whether the server still answers: a choice that ran to its length or stopped (its text may be empty: the
    server samples, and EOS may come first)."""
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    return answer.choices[0].finish_reason in ("length", "stop") and answer.usage.completion_tokens >= 1


TOOL_TEMPLATE = (  # how Qwen's templates write an assistant's tool calls
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}{% if m.tool_calls %}{% for call in "
    "m.tool_calls %}{% if call.function is defined %}{% set call = call.function %}{% endif %}<tool_call>"
    "{{ call.name }} {{ call.arguments | tojson }}</tool_call>{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.mark.parametrize("calls, param, says", [
    ([{"function": {"name": "f"}}], "messages.1.tool_calls.0.function.arguments", "is required"),
    ([1], "messages.1.tool_calls.0", "must be a JSON object"),
])
def test_a_tool_call_out_of_openais_form_is_400_naming_its_field(server, monkeypatch, calls, param, says):
    monkeypatch.setattr(server.pipe.tokenizer, "chat_template", TOOL_TEMPLATE)
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls}]
    response = post(server, "chat/completions", json={"messages": messages, "max_tokens": 1})
    assert says in assert_error(response, 400, param)["message"]


def test_a_tool_call_the_template_cannot_render_is_400(server, monkeypatch):
    """A call in OpenAI's form that this template reads otherwise (a `parameters` key it requires)."""
    monkeypatch.setattr(server.pipe.tokenizer, "chat_template", TOOL_TEMPLATE.replace(
        "call.arguments | tojson", "call.parameters['x'] | tojson"))
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls}]
    response = post(server, "chat/completions", json={"messages": messages, "max_tokens": 1})
    error = assert_error(response, 400, "messages")
    assert "chat template" in error["message"]


def test_chat_with_a_base_model_points_to_completions(server, monkeypatch):
    monkeypatch.setattr(server.pipe.tokenizer, "chat_template", None)
    error = assert_error(post(server, "chat/completions", json={"messages": MESSAGES, "max_tokens": 1}), 400,
                         "messages")
    assert "no chat template" in error["message"] and "/v1/completions" in error["message"]
    assert "raw=True" not in error["message"]  # the Python API's advice, which an HTTP client cannot take
    assert post(server, "completions", json={"prompt": "hello", "max_tokens": 1}).status_code == 200


def test_add_generation_prompt_false_renders_without_the_assistants_opening(server):
    opened = post(server, "chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "temperature": 0})
    plain = post(server, "chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "temperature": 0,
                                                   "add_generation_prompt": False})
    expected = server.pipe.tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=False)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected  # transformers 5: an encoding
    assert plain.json()["usage"]["prompt_tokens"] == len(expected)
    assert opened.json()["usage"]["prompt_tokens"] > len(expected)


CHAT_BAD = [
    ({"model": MODEL}, "messages"),  # missing messages
    ({"model": MODEL, "messages": []}, "messages"),  # empty messages
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": [{"content": "hi"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, None),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": "ten"}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 1.5}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),  # beyond the context
    ({"model": MODEL, "messages": MESSAGES, "max_completion_tokens": -5}, "max_completion_tokens"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": MESSAGES, "top_k": -3}, "top_k"),
    ({"model": MODEL, "messages": MESSAGES, "seed": "x"}, "seed"),
    ({"model": MODEL, "messages": MESSAGES, "seed": 2**64}, "seed"),
    ({"model": MODEL, "messages": MESSAGES, "temperature": 3.0}, "temperature"),
    ({"model": MODEL, "messages": MESSAGES, "stop": ["a"] * 17}, "stop"),
    ({"model": MODEL, "messages": MESSAGES, "stop": ""}, "stop"),
    ({"model": MODEL, "messages": MESSAGES, "stop": ["a", ""]}, "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content.0"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": MESSAGES, "stop": 3}, None),
    ({"model": MODEL, "messages": MESSAGES, "stream": "yes"}, "stream"),
    ({"model": MODEL, "messages": MESSAGES, "n": 0}, "n"),
    ({"model": MODEL, "messages": MESSAGES, "n": 10**6}, "n"),  # more than the server holds at once
    ({"model": MODEL, "messages": MESSAGES, "logprobs": 3}, "logprobs"),  # chat's is a boolean
    ({"model": 7, "messages": MESSAGES}, "model"),
]


@pytest.mark.parametrize("body,param", CHAT_BAD)
def test_bad_chat_requests_are_400(server, body, param):
    assert_error(post(server, "chat/completions", json=body), 400, param)


# body, param, what the message must say; none may show pydantic's type tags (content.str, prompt.list[int])
MESSAGES_SAY = [
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "must be a string, a list of text parts"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0", "needs its text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, 7]}]}, "messages.0.content.1",
     "must be a JSON object"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role",
     "use one of system, developer, user, assistant, tool"),
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": MESSAGES, "stop": 3}, "stop", "must be a string, a list of up to 16 strings"),
    ({"messages": MESSAGES, "stop": ["a", None]}, "stop.1", "must be a valid string"),
    ({"messages": MESSAGES, "stop": ["a", "x" * 1001]}, "stop", "a stop string of 1001 characters; this server takes "
                                                               "up to 1000"),
    ({"messages": MESSAGES, "logprobs": "yes"}, "logprobs", "must be a boolean, an integer or null"),
    ({"messages": MESSAGES, "max_tokens": "ten"}, "max_tokens", "must be a valid integer"),
]


@pytest.mark.parametrize("body,param,says", MESSAGES_SAY)
def test_messages_say_what_the_field_must_be(server, body, param, says):
    message = assert_error(post(server, "chat/completions", json=body), 400, param)["message"]
    assert says in message
    assert not any(tag in message for tag in (".str", ".bool", ".int", "list[", "ContentPart", "Input should"))


def test_a_lone_surrogate_in_a_message_names_the_messages(server):
    body = b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}'  # JSON escapes it; UTF-8 cannot
    response = post(server, "chat/completions", content=body, headers={"content-type": "application/json"})
    assert "a message's content is not valid text" in assert_error(response, 400, "messages")["message"]


def test_a_lone_surrogate_in_a_stop_string_names_stop(server):
    body = b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"], "max_tokens": 2}'
    response = post(server, "chat/completions", content=body, headers={"content-type": "application/json"})
    assert "the stop string '\\ud800' is not valid text" in assert_error(response, 400, "stop")["message"]


@pytest.mark.parametrize("body,param,says", [
    ({"prompt": 5}, "prompt", "must be a string, a list of token ids (integers), or a batch: a list of strings"),
    ({"prompt": [1, "a"]}, "prompt", "must be a string, a list of token ids (integers), or a batch: a list of strings"),
    ({"prompt": ["hello", [5, 6]]}, "prompt", "or a list of token id lists"),
])
def test_completion_messages_say_what_the_prompt_must_be(server, body, param, says):
    message = assert_error(post(server, "completions", json=body), 400, param)["message"]
    assert says in message and "prompt.str" not in message and "list[" not in message


def test_nan_temperature_is_not_a_range_error(server):
    message = assert_error(post(server, "chat/completions", content=NAN_TEMPERATURE,
                                headers={"content-type": "application/json"}), 400, "temperature")["message"]
    assert "finite" in message and "<=" not in message and "less than" not in message


UNSUPPORTED_CHAT = [("functions", [{"name": "f", "parameters": {}}]), ("function_call", {"name": "f"})]


@pytest.mark.parametrize("field,value", UNSUPPORTED_CHAT)
def test_options_this_server_cannot_honour_are_refused_by_name(server, field, value):
    error = assert_error(post(server, "chat/completions", json={"messages": MESSAGES, field: value}), 400, field)
    assert "not supported" in error["message"]


@pytest.mark.parametrize("field,value", [("best_of", 2), ("suffix", "return x")])
def test_completion_options_this_server_cannot_honour_are_refused_by_name(server, field, value):
    assert_error(post(server, "completions", json={"prompt": "hi", field: value}), 400, field)


def test_defaults_and_nulls_are_accepted(server):
    """null means the default, as in OpenAI's API; the refused options pass at their defaults."""
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "stop", "seed", "max_tokens", "logprobs",
                               "presence_penalty", "frequency_penalty", "logit_bias", "response_format", "tools",
                               "tool_choice", "top_logprobs", "stream_options", "user", "top_k", "echo")}
    defaults = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"},
                "tools": [], "tool_choice": "none", "top_logprobs": 0, "n": 1, "logprobs": False}
    as_vllm_reads = {"model": "", "logprobs": 0}  # no model name; chat's boolean logprobs, 0 read as false
    for extra in (nulls, defaults, as_vllm_reads):
        body = {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 2, **extra}
        response = post(server, "chat/completions", json=body)
        assert response.status_code == 200, response.text
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "best_of": 1, "suffix": None, "echo": None,
                  "temperature": None, "top_p": None, "n": None, "stream": None, "response_format": {"type": "text"}}
    response = post(server, "completions", json=completion)
    assert response.status_code == 200, response.text


def greedy(server, messages) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = post(server, "chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_text_parts_are_joined_with_newlines_and_developer_is_system(server):
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    joined = [{"role": "user", "content": "one\ntwo"}]
    a, b = greedy(server, parts), greedy(server, joined)
    assert a["usage"] == b["usage"] and a["choices"] == b["choices"]
    system = [{"role": "system", "content": "be brief"}, *MESSAGES]
    developer = [{"role": "developer", "content": "be brief"}, *MESSAGES]
    a, b = greedy(server, developer), greedy(server, system)
    assert a["usage"] == b["usage"] and a["choices"] == b["choices"]


@pytest.mark.parametrize("body", [
    {"model": MODEL},
    {"model": MODEL, "prompt": ""},
    {"model": MODEL, "prompt": []},
    {"model": MODEL, "prompt": ["a", ""]},  # a batch's prompt 1 is empty
    {"model": MODEL, "prompt": [[1], [10**6]]},  # a batch's prompt 1 holds a token id outside the vocabulary
    {"model": MODEL, "prompt": [[]]},
    {"model": MODEL, "prompt": [[1, "a"]]},
    {"model": MODEL, "prompt": [1, "a"]},
    {"model": MODEL, "prompt": [10**6]},  # a token id outside the vocabulary
    {"model": MODEL, "prompt": "hi", "max_tokens": -2},
    {"model": MODEL, "prompt": "hi", "max_tokens": 0},  # 0 only with echo (scoring the prompt)
    {"model": MODEL, "prompt": "hi", "echo": True, "logprobs": 21},
])
def test_bad_completion_requests_are_400(server, body):
    assert_error(post(server, "completions", json=body), 400)


def test_prompt_plus_max_tokens_beyond_context(server, client):
    context = server.server_state.max_model_len
    prompt = (list(range(10, 60)) * (context // 50 + 1))[:context]  # the whole context in token ids
    error = assert_error(post(server, "completions", json={"model": MODEL, "prompt": prompt[: context - 100],
                                                           "max_tokens": 200}), 400, "max_tokens")
    assert error["code"] == "context_length_exceeded" and str(context) in error["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=prompt[:context], max_tokens=1)


def test_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=4)
    assert err.value.body["code"] == "model_not_found"
    assert assert_error(httpx.get(f"{server.url}/v1/nowhere"), 404)["type"] == "invalid_request_error"  # as OpenAI


def test_a_method_the_path_does_not_take_is_405_with_allow(server):
    response = httpx.get(f"{server.url}/v1/chat/completions")
    assert_error(response, 405)
    assert response.headers["allow"] == "POST"  # RFC 9110: a 405 names the methods the path takes


def test_openai_client_sees_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    assert err.value.status_code == 400


def test_still_serving_after_every_mistake(server, client):
    """Runs after the error tests above (file order): nothing broke, nothing leaked a slot, no 500."""
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    assert isinstance(out.choices[0].message.content, str)
    health = httpx.get(f"{server.url}/health").json()
    assert health == {"status": "ok", "running": 0, "waiting": 0}
    # the counter itself: a `_created` series beside it (unless a test has run `dflash serve`, which turns those off
    # for the whole process) holds a timestamp
    assert server.metrics()['dflash:request_success_total{finished_reason="error"}'] == 0


def test_api_key(start_server):
    locked = start_server(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        locked.client(api_key="wrong").models.list()
    assert_error(httpx.post(f"{locked.url}/v1/chat/completions", json={"messages": MESSAGES}), 401)
    assert_error(httpx.get(f"{locked.url}/v1/models", headers={"Authorization": "s3cret"}), 401)
    assert_error(httpx.get(f"{locked.url}/v1/models", headers={"Authorization": "Basic s3cret"}), 401)
    assert_error(httpx.get(f"{locked.url}/v1/models/{MODEL}"), 401)
    for scheme in ("bearer", "BEARER", "Bearer"):  # the scheme is case-insensitive (RFC 9110)
        response = httpx.get(f"{locked.url}/v1/models", headers={"Authorization": f"{scheme} s3cret"})
        assert response.status_code == 200, (scheme, response.text)
    out = locked.client(api_key="s3cret").chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert out.usage.completion_tokens >= 1
    assert httpx.get(f"{locked.url}/health").status_code == 200  # probes need no key


def test_a_trailing_slash_reaches_the_same_endpoint(server):
    response = httpx.post(f"{server.url}/v1/completions/", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] <= 2
    assert httpx.get(f"{server.url}/v1/models/").json()["data"][0]["id"] == MODEL


# ---- what clients moving from vLLM send ---------------------------------------------------------------------
VLLM_REFUSED = [
    ("bad_words", ["x"]),
    ("allowed_token_ids", [1, 2]), ("use_beam_search", True), ("truncate_prompt_tokens", 8),
    ("include_stop_str_in_output", True), ("skip_special_tokens", False), ("spaces_between_special_tokens", False),
    ("guided_grammar", "start: a"), ("structured_outputs", {"json": {}}), ("chat_template", "{{ messages }}"),
    ("documents", [{"text": "x"}]),
]


@pytest.mark.parametrize("field,value", VLLM_REFUSED)
def test_vllm_options_this_server_cannot_honour_are_refused_by_name(server, field, value):
    error = assert_error(post(server, "chat/completions", json={"messages": MESSAGES, field: value}), 400, field)
    assert "not supported" in error["message"] and f"leave {field} out" in error["message"]


def test_vllm_options_at_their_defaults_are_accepted(server):
    defaults = {"repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "use_beam_search": False,
                "include_stop_str_in_output": False, "skip_special_tokens": True, "guided_json": None,
                "add_generation_prompt": True, "continue_final_message": False, "stop_token_ids": []}
    response = post(server, "chat/completions", json={"messages": MESSAGES, "max_tokens": 2, **defaults})
    assert response.status_code == 200, response.text


def test_stream_options_without_stream_is_400(server):
    body = {"messages": MESSAGES, "max_tokens": 2, "stream_options": {"include_usage": True}}
    error = assert_error(post(server, "chat/completions", json=body), 400, "stream_options")
    assert "stream=true" in error["message"]


@pytest.mark.parametrize("role", ["user", "system", "tool"])
def test_a_message_without_content_is_400_unless_an_assistant_calls_tools(server, role):
    assert_error(post(server, "chat/completions", json={"messages": [{"role": role, "content": None}]}), 400)
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "content": "42", "tool_call_id": "c1"}, {"role": "user", "content": "and?"}]
    response = post(server, "chat/completions", json={"messages": history, "max_tokens": 2})
    assert response.status_code == 200, response.text


def test_continue_final_message_continues_the_assistants_answer(server):
    tokenizer = server.pipe.tokenizer
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "continue_final_message": True, "add_generation_prompt": False}
    response = post(server, "chat/completions", json=body)
    assert response.status_code == 200, response.text
    ids = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ids.endswith("The answer is")  # no new turn opened after the prefill
    expected_ids = server.pipe.encode(messages, continue_final_message=True)
    assert response.json()["usage"]["prompt_tokens"] == len(expected_ids)
    opened = post(server, "chat/completions", json={**body, "continue_final_message": False,
                                                    "add_generation_prompt": True})
    assert opened.json()["usage"]["prompt_tokens"] != len(expected_ids)
    expected = server.pipe.generate(expected_ids, max_new_tokens=6, ignore_eos=True).text
    assert response.json()["choices"][0]["message"]["content"] == expected
    both = {**body, "add_generation_prompt": True}
    assert "add_generation_prompt=false" in assert_error(post(server, "chat/completions", json=both), 400,
                                                         "continue_final_message")["message"]
    after_user = {**body, "messages": MESSAGES}
    assert_error(post(server, "chat/completions", json=after_user), 400, "continue_final_message")


def test_stop_token_ids_stop_the_answer_at_that_token(server):
    ids = server.pipe.encode(MESSAGES)
    plain = server.pipe.generate(ids, max_new_tokens=12, ignore_eos=True)
    stop_at = plain.output_ids[4]
    first = plain.output_ids.index(stop_at)
    body = {"prompt": ids, "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop_at], "ignore_eos": True}
    out = post(server, "completions", json=body).json()
    assert out["usage"]["completion_tokens"] == first + 1 and out["choices"][0]["finish_reason"] == "stop"
    # its text is left out, as vLLM leaves it out (include_stop_str_in_output off), streamed or not
    kept = server.pipe.tokenizer.decode(plain.output_ids[:first], skip_special_tokens=True)
    assert out["choices"][0]["text"] == kept != server.pipe.tokenizer.decode(plain.output_ids[: first + 1])
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == kept
    for bad in (10**9, -1):
        error = assert_error(post(server, "completions", json={**body, "stop_token_ids": [bad]}), 400, "stop_token_ids")
        assert f"stop_token_ids [{bad}] are outside the vocabulary" in error["message"]


def test_cors_headers_only_for_the_allowed_origins(start_server, server):
    preflight = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    assert "access-control-allow-origin" not in httpx.options(f"{server.url}/v1/chat/completions",
                                                              headers=preflight).headers
    open_to_one = start_server(allowed_origins=("http://localhost:3000",), api_key="k")
    answer = httpx.options(f"{open_to_one.url}/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = httpx.options(f"{open_to_one.url}/v1/chat/completions", headers={**preflight, "Origin": "http://evil"})
    assert "access-control-allow-origin" not in other.headers
    assert other.status_code == 400 and other.json()["error"]["code"] == "cors_refused"  # was plain text
    assert other.json()["error"]["message"].startswith("Disallowed CORS origin: this server answers browsers")
    response = httpx.post(f"{open_to_one.url}/v1/chat/completions", headers={"Origin": "http://localhost:3000",
                          "Authorization": "Bearer k"}, json={"messages": MESSAGES, "max_tokens": 2}, timeout=30)
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_a_template_variable_named_like_an_argument_of_dflashs_own_is_no_500(server):
    """`tokenizer` (and `messages`, reserved) are render_chat's own parameter names: a template variable of that
    name once reached it as a second value for its argument, a TypeError and a 500."""
    response = post(server, "chat/completions", json={
        "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"tokenizer": 1}})
    assert response.status_code == 200, response.text
    assert_error(post(server, "chat/completions", json={
        "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"messages": 1}}), 400, "chat_template_kwargs")


def test_after_an_unexpected_error_the_connection_serves_the_next_request(start_server, monkeypatch, caplog):
    """A bug answers 500 with an error object, logged; the client's next request on the same keep-alive
    connection is answered. (Starlette's handler raised the error again after answering, and uvicorn dropped the
    connection without saying so: the next request on it failed with a reset.)"""
    import http.client
    import json

    import dflash.chat

    live = start_server()
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    connection = http.client.HTTPConnection("127.0.0.1", live.port, timeout=60)

    def ask() -> tuple[int, dict]:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    try:
        assert ask()[0] == 200
        monkeypatch.setattr(dflash.chat, "render_chat", broken)
        with caplog.at_level("ERROR"):
            status, answer = ask()
        assert status == 500 and answer["error"]["message"] == "internal server error (RuntimeError)"
        assert "RuntimeError: a bug" in caplog.text
        monkeypatch.undo()
        socket_before = connection.sock
        status, answer = ask()  # raised RemoteDisconnected / ConnectionResetError before
        assert status == 200 and answer["choices"][0]["message"]["content"] is not None
        assert connection.sock is socket_before  # the same connection, not a new one
    finally:
        connection.close()


def test_a_negative_token_limit_is_said_as_a_limit_of_zero_is():
    """-5 said "must be greater than or equal to 0", while 0 said "must be at least 1"."""
    from dflash.serve.protocol import APIError, ChatCompletionRequest, parse_request

    for field in ("max_tokens", "max_completion_tokens"):
        for value in (-5, 0):
            with pytest.raises(APIError) as caught:
                body = json.dumps({"messages": MESSAGES, field: value}).encode()
                parse_request(body, ChatCompletionRequest).check_supported()
            assert caught.value.param == field
            assert str(caught.value.message).startswith(f"{field}: must be at least 1 (the number of new tokens")
