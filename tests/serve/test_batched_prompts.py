"""/v1/completions with a batch of prompts (OpenAI's list of strings or of token id lists, as lm-eval sends them at
--batch_size above 1): each prompt's n choices are the answers a request of that prompt alone gets, numbered
p * n + i; usage counts each prompt once; streamed as whole; a bad prompt is named by its index."""

from __future__ import annotations

import json

import httpx
import pytest

from .test_api import MODEL

PROMPTS = ["12 apples and 5 pears", "Natalia sold clips", "How many"]


def complete(server, **fields) -> dict:
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **fields}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def texts(answer: dict) -> list[str]:
    assert [c["index"] for c in answer["choices"]] == list(range(len(answer["choices"])))
    return [c["text"] for c in answer["choices"]]


@pytest.mark.parametrize("sampled", [False, True])
def test_each_prompts_choices_are_its_own_requests(server, sampled):
    fields = dict(temperature=1.0, seed=7, top_k=20) if sampled else {}
    batch = complete(server, prompt=PROMPTS, n=2, **fields)
    alone = [complete(server, prompt=p, n=2, **fields) for p in PROMPTS]
    assert texts(batch) == [t for a in alone for t in texts(a)]
    assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert batch["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone) == 36
    assert len(set(texts(batch))) > 1


def test_a_batch_of_token_ids_with_echo_and_logprobs_scores_each_prompt(server):
    """lm-eval's loglikelihood requests: token ids, echo, logprobs and max_tokens 0, several per request."""
    ids = [server.pipe.encode(p, raw=True) for p in PROMPTS[:2]]
    batch = complete(server, prompt=ids, echo=True, logprobs=1, max_tokens=0)
    alone = [complete(server, prompt=p, echo=True, logprobs=1, max_tokens=0) for p in ids]
    for got, want in zip(batch["choices"], [a["choices"][0] for a in alone]):
        assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-5)
    assert [c["text"] for c in batch["choices"]] == [server.pipe.tokenizer.decode(i) for i in ids]


def test_a_streamed_batch_adds_up_to_the_whole_one(server):
    whole = texts(complete(server, prompt=PROMPTS, n=2, echo=True))
    body = {"model": MODEL, "prompt": PROMPTS, "n": 2, "echo": True, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    streamed = [""] * len(whole)
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == whole and all(t.startswith(p) for t, p in zip(whole, [p for p in PROMPTS for _ in "ab"]))
    assert chunks[-1]["usage"]["completion_tokens"] == 36


def test_the_openai_client_sends_a_batch(server):
    out = server.client().completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=4, temperature=0)
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens <= 8


@pytest.mark.parametrize("prompt, fields, says", [
    (["fine", ""], {}, "prompt 1 is empty"),
    ([[5, 6], [10**6]], {}, "prompt 1: "),
    (PROMPTS, {"n": 9}, "3 prompts x n=9 choices are more than this server decodes and queues at once"),
    (["fine", "x " * 5000], {"max_tokens": 5}, "prompt 1: "),
])
def test_a_bad_prompt_of_a_batch_is_named(server, prompt, fields, says):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt, **fields},
                          timeout=60)
    assert response.status_code == 400 and says in response.json()["error"]["message"], response.text
