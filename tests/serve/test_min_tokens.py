"""vLLM's min_tokens: no stop (EOS, stop_token_ids, stop strings) before that many tokens, streamed or not, as the
library decodes it; a min_tokens the answer cannot hold, or one beside a grammar, is a 400 naming it."""

from __future__ import annotations

import json

import httpx
import pytest

from .test_api import MODEL

PROMPT = "12 apples and 5 pears"


def _complete(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def _streamed_text(server, **fields) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stream": True, **fields}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    return "".join(json.loads(line)["choices"][0]["text"] for line in lines if json.loads(line)["choices"])


def test_min_tokens_holds_the_eos_back_as_the_library_does(server):
    """A logit bias makes EOS the first token; min_tokens makes it the sixth, as the library's min_new_tokens."""
    eos = server.pipe.tokenizer.eos_token_id
    bias = {str(eos): 100}
    at_once = _complete(server, logit_bias=bias).json()
    assert at_once["usage"]["completion_tokens"] <= 1 and at_once["choices"][0]["text"] == ""
    held = _complete(server, logit_bias=bias, min_tokens=5).json()
    ids = server.pipe.encode(PROMPT, raw=True)
    library = server.pipe.generate(ids, raw=True, max_new_tokens=12, min_new_tokens=5, logit_bias={eos: 100})
    assert held["choices"][0]["text"] == library.text != ""
    assert library.output_ids[5:] == [eos] and held["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_in_the_first_min_tokens_is_text(server):
    """A stop string the first tokens' text holds does not stop the answer, streamed or not."""
    ids = server.pipe.encode(PROMPT, raw=True)
    plain = server.pipe.generate(ids, raw=True, max_new_tokens=12, ignore_eos=True)
    stop = plain.text[1:3]  # in the first tokens' text
    assert stop and _complete(server, stop=[stop], ignore_eos=True).json()["choices"][0]["text"] == plain.text[:1]
    held = _complete(server, stop=[stop], ignore_eos=True, min_tokens=6).json()["choices"][0]
    library = server.pipe.generate(ids, raw=True, max_new_tokens=12, ignore_eos=True, stop_strings=[stop],
                                   min_new_tokens=6)
    assert held["text"] == library.text and held["text"].startswith(plain.text[:3])
    assert _streamed_text(server, stop=[stop], ignore_eos=True, min_tokens=6) == held["text"]


@pytest.mark.parametrize("fields, says", [
    ({"min_tokens": 13}, "min_tokens=13 is more than this answer's token limit, 12"),
    ({"min_tokens": 3, "guided_regex": "a+"}, "min_tokens with guided_regex"),
    ({"min_tokens": -1}, "greater than or equal to 0"),
    ({"min_tokens": "4"}, "integer"),
])
def test_a_min_tokens_the_answer_cannot_take_is_a_400_naming_it(server, fields, says):
    refused = _complete(server, **fields)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens", refused.text
    assert says in refused.json()["error"]["message"], refused.text
