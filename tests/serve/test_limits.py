"""What a request may ask: prompt + max_tokens within the context (one rule, stated in the error), and a
body no larger than --max-request-bytes (413). Tokenising a long prompt does not stall the event loop."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from dflash.errors import UserError
from dflash.serve.limits import check_max_model_len

MODEL = "tiny"  # the served model name the fixtures use
IDS = list(range(10, 110))  # token ids inside the tiny vocabulary


def complete(server, **body) -> httpx.Response:
    body = {"model": MODEL, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def refused(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param
    return error["message"]


@pytest.fixture(scope="module")
def short(start_server):
    """--max-model-len 64, far inside the tiny target's 1024: all 64 tokens are usable (block size 8)."""
    return start_server(max_model_len=64)


def test_prompt_plus_max_tokens_may_fill_the_context_exactly(short):
    for prompt_len, max_tokens in [(48, 16), (47, 17), (1, 63)]:
        response = complete(short, prompt=IDS[:prompt_len], max_tokens=max_tokens)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["total_tokens"] == 64
    message = refused(complete(short, prompt=IDS[:48], max_tokens=17), "max_tokens")
    assert "the context of 64 tokens" in message and "at most 16" in message


def test_a_prompt_that_fills_the_context_is_refused(short):
    message = refused(complete(short, prompt=IDS[:64], max_tokens=1), "prompt")
    assert "the prompt (64 tokens) leaves no room" in message and "64" in message


def test_the_completions_default_max_tokens_does_not_shrink_silently(short):
    assert complete(short, prompt=IDS[:48]).json()["usage"]["completion_tokens"] == 16
    message = refused(complete(short, prompt=IDS[:50]), "max_tokens")
    assert "the default for completions" in message and "at most 14" in message


def test_max_completion_tokens_is_named_when_it_is_the_one_given(short):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 500}
    response = httpx.post(f"{short.url}/v1/chat/completions", json=body, timeout=60)
    message = refused(response, "max_completion_tokens")
    assert "max_completion_tokens (500)" in message and "max_tokens (" not in message


def test_without_max_model_len_a_sequence_may_fill_the_targets_context(server):
    """The steps near the context's end verify shorter blocks: prompt + max_tokens may reach the target's 1024."""
    assert server.server_state.max_model_len == 1024
    response = complete(server, prompt=(IDS * 11)[:1000], max_tokens=24)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["total_tokens"] == 1024
    message = refused(complete(server, prompt=(IDS * 11)[:1024], max_tokens=1), "prompt")
    assert "the prompt (1024 tokens) leaves no room for new tokens in the context of 1024 tokens" in message


def test_max_model_len_rule():
    assert check_max_model_len(None, 1024) == 1024
    assert check_max_model_len(1000, 1024) == 1000
    with pytest.raises(UserError, match="exceeds the target's context of 1024"):
        check_max_model_len(2048, 1024)
    with pytest.raises(UserError, match="--max-model-len"):
        check_max_model_len(None, None)


# ---- request bodies --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_bodies(start_server):
    return start_server(max_request_bytes=2000)


def test_a_body_over_the_limit_is_413(small_bodies):
    url = f"{small_bodies.url}/v1/completions"
    ok = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200, ok.text
    big = {"model": MODEL, "prompt": "hi " * 1000, "max_tokens": 2}
    response = httpx.post(url, json=big, timeout=30)
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and "2000 bytes" in error["message"]
    assert "--max-request-bytes" in error["message"]

    def chunks():  # no Content-Length: the limit holds while the body streams in
        for _ in range(10):
            yield b" " * 500

    streamed = httpx.post(url, content=chunks(), headers={"content-type": "application/json"}, timeout=30)
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{small_bodies.url}/health").json()["status"] == "ok"


def test_tokenising_does_not_stall_the_event_loop(start_server):
    """A prompt that takes a while to tokenise (here: 1 s) must not hold up /health or other streams."""
    server = start_server()
    encode = server.pipe.encode

    def slow_encode(*args, **kwargs):
        time.sleep(1.0)
        return encode(*args, **kwargs)

    server.pipe.encode = slow_encode
    asking = threading.Thread(target=complete, args=(server,), kwargs={"prompt": "hello", "max_tokens": 2})
    asking.start()
    time.sleep(0.2)  # the request is tokenising now
    started = time.monotonic()
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    waited = time.monotonic() - started
    asking.join(30)
    assert waited < 0.5, f"/health waited {waited:.2f} s for a prompt to be tokenised"
