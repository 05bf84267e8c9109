"""Several choices per request (n): decoded together, each what a request of one would answer (with a seed, choice
i samples with seed + i, as vLLM does), streamed apart by index, counted together in usage."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from .test_api import MODEL, PROMPTS, chat


def completion(client, **kw):
    kw.setdefault("max_tokens", 12)
    return client.completions.create(model=MODEL, prompt=PROMPTS[2], extra_body={"ignore_eos": True}, **kw)


def test_seeded_choices_are_the_single_answers_of_seed_plus_i(client):
    out = completion(client, n=3, temperature=0.9, seed=11)
    assert [c.index for c in out.choices] == [0, 1, 2]
    singles = [completion(client, temperature=0.9, seed=11 + i).choices[0].text for i in range(3)]
    assert [c.text for c in out.choices] == singles
    assert len(set(singles)) > 1  # different seeds, different samples
    assert out.usage.completion_tokens == 3 * 12 and out.usage.prompt_tokens == completion(client).usage.prompt_tokens


def test_greedy_choices_are_all_the_one_answer(client):
    one = chat(client, max_tokens=10)
    assert [c.message.content for c in chat(client, max_tokens=10, n=2).choices] == [one.choices[0].message.content] * 2


def test_each_choice_carries_its_own_logprobs(client):
    many = completion(client, n=2, temperature=0.9, seed=3, logprobs=1)
    singles = [completion(client, temperature=0.9, seed=3 + i, logprobs=1).choices[0] for i in range(2)]
    assert [c.logprobs.tokens for c in many.choices] == [s.logprobs.tokens for s in singles]
    assert many.choices[0].logprobs.tokens != many.choices[1].logprobs.tokens


def test_seeds_past_the_range_and_best_of_n(client):
    with pytest.raises(openai.BadRequestError) as err:
        completion(client, n=2, temperature=0.9, seed=2**64 - 1)
    assert err.value.body["param"] == "seed" and "n=2" in err.value.body["message"]
    assert len(completion(client, n=2, temperature=0.9, seed=1, best_of=2).choices) == 2  # the best 2 of 2


def test_streamed_choices_add_up_by_index_to_the_answer(server, client):
    whole = completion(client, n=3, temperature=0.9, seed=5)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={
            "model": MODEL, "prompt": PROMPTS[2], "max_tokens": 12, "n": 3, "temperature": 0.9, "seed": 5,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    texts, finished = ["", "", ""], [None] * 3
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        finished[choice["index"]] = choice["finish_reason"] or finished[choice["index"]]
    assert texts == [c.text for c in whole.choices] and finished == ["length"] * 3
    assert chunks[-1]["usage"]["completion_tokens"] == 36 and chunks[-1]["choices"] == []
    by_index: dict[int, str] = {}
    roles = []
    for chunk in chat(client, max_tokens=8, n=2, stream=True):
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
            roles += [choice.index] if choice.delta.role else []
    answer = chat(client, max_tokens=8).choices[0].message.content
    assert by_index == {0: answer, 1: answer} and sorted(roles) == [0, 1]  # each choice opens with its role


def test_all_choices_are_refused_when_they_do_not_all_fit(start_server):
    """n choices take n places: a request that cannot have them all is refused whole, and holds none."""
    from dflash.serve.scheduler import SchedulerConfig

    small = start_server(scheduler=SchedulerConfig(max_batch_size=2, max_queue=1))
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4}
    assert httpx.post(f"{small.url}/v1/completions", json={**body, "n": 3}).status_code == 200
    too_many = httpx.post(f"{small.url}/v1/completions", json={**body, "n": 4})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
    assert "at most that" in too_many.json()["error"]["message"]
