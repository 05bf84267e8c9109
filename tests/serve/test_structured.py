"""Structured output through the server: OpenAI's response_format (json_object, json_schema) and vLLM's
guided_json, guided_regex and guided_choice hold the answer as the library's json_schema and regex do."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time

import httpx
import pytest

from conftest import byte_fallback_tokenizer, save_tiny_pair

from .conftest import MODEL, serving

PROMPT = "12 apples and 5 pears"
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["answer", "n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def json_server(tmp_path_factory):
    """A server whose tokenizer writes any character (the shared one's cannot write a brace)."""
    pair = save_tiny_pair(tmp_path_factory.mktemp("bytes_pair"), tokenizer=byte_fallback_tokenizer())
    with serving(pair) as server:
        yield server


def complete(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_json_schema_holds_the_answer_as_the_librarys(json_server):
    ids = json_server.pipe.encode(PROMPT, raw=True)
    library = json_server.pipe.generate(ids, raw=True, max_new_tokens=40, json_schema=SCHEMA).text
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for fields in (dict(response_format=response_format), dict(guided_json=SCHEMA),
                   dict(guided_json=json.dumps(SCHEMA))):
        assert text_of(complete(json_server, **fields)) == library
    answer = json.loads(library)
    assert answer["answer"] in ("yes", "no") and 0 <= answer["n"] <= 999
    streamed = httpx.post(f"{json_server.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True, "guided_json": SCHEMA})
    pieces = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(pieces) == library


def test_json_object_gives_a_json_object(json_server):
    text = text_of(complete(json_server, max_tokens=60, temperature=1.0, seed=3, top_k=5,
                            response_format={"type": "json_object"}))
    assert text.startswith("{")  # a random model may not close it within max_tokens; what it wrote is an object's


def test_a_regex_or_choice_holds_the_answer(json_server):
    ids = json_server.pipe.encode(PROMPT, raw=True)
    regex = "(April|May) [0-9]{1,2}"
    library = json_server.pipe.generate(ids, raw=True, max_new_tokens=40, regex=regex).text
    assert text_of(complete(json_server, guided_regex=regex)) == library and re.fullmatch(regex, library)
    choices = ["April?", "in (May)"]  # regex specials, taken literally
    for seed in range(3):
        assert text_of(complete(json_server, temperature=1.0, seed=seed, guided_choice=choices)) in choices


@pytest.mark.parametrize("fields, param, says", [
    (dict(guided_regex="(unclosed"), "guided_regex", "the regex cannot be used"),
    (dict(guided_json="{not json"), "guided_json", "not JSON"),
    (dict(guided_regex="a+", guided_choice=["a"]), "guided_choice", "each set the answer's structure"),
    (dict(response_format={"type": "json_schema"}), "response_format", "needs a json_schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type", "json_object"),
    (dict(guided_grammar="start: a"), "guided_grammar", "not supported"),
    (dict(guided_json=SCHEMA, ignore_eos=True), None, "drop ignore_eos"),
])
def test_a_structure_it_cannot_hold_is_a_400_naming_the_field(json_server, fields, param, says):
    response = complete(json_server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert text_of(complete(json_server, max_tokens=2))  # and the server goes on


def test_a_tokenizer_llguidance_cannot_read_is_a_400_that_says_so(server):
    """The shared server's tokenizer has a Metaspace decoder, which llguidance does not read."""
    response = complete(server, response_format={"type": "json_object"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and "llguidance cannot read this tokenizer" in error["message"]


def test_a_grammar_past_llguidances_limits_fails_that_request_alone_saying_so(json_server):
    response = complete(json_server, guided_regex="(a{1000}){1000}")
    error = response.json()["error"]
    assert response.status_code == 500 and "the answer's grammar failed in llguidance" in error["message"], error
    assert "\n" not in error["message"] and "<state>" not in error["message"]
    assert text_of(complete(json_server, max_tokens=2))  # and the server goes on


def test_a_grammar_compiles_off_the_event_loop(json_server, monkeypatch):
    """While a request's grammar compiles (held here until /health has answered), the server goes on answering:
    compiled on the event loop, /health would wait for it and time out."""
    engine, compiled = json_server.pipe.engine, threading.Event()
    grammar = engine.grammar_for

    def slow_grammar(config):
        compiled.wait(timeout=20)
        return grammar(config)

    monkeypatch.setattr(engine, "grammar_for", slow_grammar)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete, json_server, guided_regex="(April|May) [0-9]")
        try:
            time.sleep(0.2)  # the request reaches its grammar
            assert httpx.get(f"{json_server.url}/health", timeout=5).status_code == 200
        finally:
            compiled.set()
        assert re.fullmatch("(April|May) [0-9]", text_of(pending.result(timeout=60)))
