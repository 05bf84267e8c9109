"""The endpoints through the official openai client: answers match the library, streams match answers,
and concurrent requests decode together yet answer exactly as they would alone (greedy)."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from dflash.api import DFlash
from dflash.serve.fallback import FallbackConfig
from dflash.serve.metrics import ServerMetrics
from dflash.serve.scheduler import Scheduler

MODEL = "tiny"  # the served model name the fixtures use

QUESTION = [{"role": "user", "content": "How many clips did Natalia sell in April and May?"}]
PROMPTS = [
    "Natalia sold clips to 48 of her friends",
    "Weng earns 12 dollars an hour",
    "How much did she earn?",
    "Please reason step by step",
    "The answer is 72.",
    "She sold half as many clips in May",
    "Yesterday, she just did 50 minutes of babysitting.",
    "put your final answer within boxed",
    "How many clips",
    "altogether in April and May",
]


def chat(client, messages=QUESTION, **kw):
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def stream_text(stream) -> tuple[str, str | None, object]:
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            pieces.append(piece or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    card = httpx.get(f"{server.url}/v1/models/{MODEL}").json()
    assert card["max_model_len"] == server.server_state.max_model_len
    for unknown in ("gpt-9", "org/name"):
        with pytest.raises(openai.NotFoundError) as err:
            client.models.retrieve(unknown)
        assert err.value.body["code"] == "model_not_found"
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["running"] == 0


def test_chat_matches_the_library(server, client):
    out = chat(client, max_tokens=20, extra_body={"ignore_eos": True})
    expected = server.pipe.generate(QUESTION, max_new_tokens=20, ignore_eos=True)
    assert out.choices[0].message.content == expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 20
    assert out.usage.prompt_tokens == len(server.pipe.encode(QUESTION))


def test_stream_equals_non_stream(client):
    plain = chat(client, max_tokens=30).choices[0].message.content
    streamed, finish, usage = stream_text(chat(client, max_tokens=30, stream=True,
                                               stream_options={"include_usage": True}))
    assert streamed == plain and plain
    assert finish in ("stop", "length") and usage.completion_tokens > 0
    # a stop string from the middle of the answer: both cut there, the stream never shows it
    stop = plain[len(plain) // 2: len(plain) // 2 + 3]
    cut = chat(client, max_tokens=30, stop=[stop]).choices[0].message.content
    streamed_cut, finish_cut, _ = stream_text(chat(client, max_tokens=30, stop=[stop], stream=True))
    assert cut == plain[: plain.find(stop)] and streamed_cut == cut and finish_cut == "stop"
    bare = chat(client, max_tokens=30, stop=stop).model_dump()["choices"][0]  # OpenAI takes one string as it is
    assert (bare["message"]["content"], bare["stop_reason"]) == (cut, stop)


def test_stop_reason_names_what_ended_the_answer_as_vllm_does(server, client):
    """A stop string, or the request's own stop token id; null for a length limit or the target's EOS. Streams
    with include_usage carry "usage": null until their usage chunk, as OpenAI's do."""
    plain = chat(client, max_tokens=30, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = plain[len(plain) // 2: len(plain) // 2 + 3]
    by_string = chat(client, max_tokens=30, stop=["never in it", stop]).model_dump()["choices"][0]
    assert by_string["finish_reason"] == "stop" and by_string["stop_reason"] == stop
    token = server.pipe.generate(QUESTION, max_new_tokens=5, ignore_eos=True).output_ids[4]
    by_id = chat(client, max_tokens=30, extra_body={"stop_token_ids": [token]}).model_dump()["choices"][0]
    assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == token
    by_length = chat(client, max_tokens=3, extra_body={"ignore_eos": True}).model_dump()["choices"][0]
    assert by_length["finish_reason"] == "length" and by_length["stop_reason"] is None
    # an EOS id the request names, with EOS ignored, stops as the request's own id (vLLM's check_stop)
    eos = server.pipe.target.eos_token_ids
    server.pipe.target.eos_token_ids = lambda: [token]
    try:
        as_eos = chat(client, max_tokens=30, extra_body={"stop_token_ids": [token]}).model_dump()["choices"][0]
        named = chat(client, max_tokens=30, extra_body={"stop_token_ids": [token], "ignore_eos": True}).model_dump()
    finally:
        server.pipe.target.eos_token_ids = eos
    assert as_eos["finish_reason"] == "stop" and as_eos["stop_reason"] is None
    assert named["choices"][0]["finish_reason"] == "stop" and named["choices"][0]["stop_reason"] == token
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={
            "model": MODEL, "messages": QUESTION, "max_tokens": 30, "temperature": 0, "stop": [stop], "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1]) and chunks[-1]["usage"]["total_tokens"]
    assert [c["choices"][0]["stop_reason"] for c in chunks[:-1]][-1] == stop


def test_completions(server, client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    ids = server.pipe.encode(PROMPTS[0], raw=True)
    assert out.choices[0].text == server.pipe.generate(ids, max_new_tokens=12, ignore_eos=True).text
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 12
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == out.choices[0].text
    streamed, finish, _ = stream_text(client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == out.choices[0].text and finish == "length"
    default = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0,
                                        extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions


def test_every_openai_prompt_form_gives_the_same_answer(server, client):
    """A string, a list of one string, token ids, and a list of one list of token ids (lm-eval's form)."""
    ids = server.pipe.encode(PROMPTS[0], raw=True)
    texts = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
             for prompt in (PROMPTS[0], [PROMPTS[0]], ids, [ids])]
    assert texts == [texts[0]] * 4


def test_seeded_sampling_repeats_alone_in_a_batch_and_without_the_drafter(client, tiny_pair):
    """A seed fixes the text: the same alone or decoded with other requests, and the same as the target alone."""
    def ask(i: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=16, temperature=0.9, top_p=0.9,
                                          seed=7, extra_body={"ignore_eos": True}).choices[0].text

    alone = [ask(i) for i in range(len(PROMPTS))]
    assert ask(1) == alone[1]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(ask, range(len(PROMPTS)))) == alone
    plain = DFlash.from_pretrained(*map(str, tiny_pair), no_draft=True, dtype="float32", device="cpu")
    assert [plain.generate(p, raw=True, max_new_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True).text
            for p in PROMPTS] == alone


def test_parallel_equals_sequential(server, client):
    """The text, why it ended and the tokens it counts: each the same alone or decoded with others."""
    def ask(i: int) -> tuple[str, str, int]:
        out = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=8 + 3 * i, temperature=0,
                                        extra_body={"ignore_eos": True})
        return out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens

    sequential = [ask(i) for i in range(len(PROMPTS))]
    before = server.metrics()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        parallel = list(pool.map(ask, range(len(PROMPTS))))
    after = server.metrics()
    assert parallel == sequential
    # they really decoded together: some steps ran more than one row
    steps = after["dflash:step_batch_size_count"] - before["dflash:step_batch_size_count"]
    single = after['dflash:step_batch_size_bucket{le="1.0"}'] - before['dflash:step_batch_size_bucket{le="1.0"}']
    assert steps > single


def test_metrics_move(server, client):
    before = server.metrics()
    chat(client, max_tokens=10, extra_body={"ignore_eos": True})
    after = server.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew('dflash:request_success_total{finished_reason="length"}') == 1
    assert grew("dflash:generation_tokens_total") == 10
    assert grew("dflash:prompt_tokens_total") > 0
    assert grew("dflash:time_to_first_token_seconds_count") == 1
    assert grew("dflash:e2e_request_latency_seconds_count") == 1
    drafts = grew("dflash:spec_decode_num_drafts_total")
    assert drafts >= 1  # 9 tokens after the prefill's first; each drafted step keeps >= 1
    draft_tokens = grew("dflash:spec_decode_num_draft_tokens_total")
    assert drafts <= draft_tokens <= drafts * 7  # block size 8, or what the request still wants
    accepted = grew("dflash:spec_decode_num_accepted_tokens_total")
    assert accepted <= draft_tokens
    per_pos = sum(v - before.get(k, 0.0) for k, v in after.items()
                  if k.startswith("dflash:spec_decode_num_accepted_tokens_per_pos_total"))
    assert per_pos == accepted
    assert after["dflash:spec_decode_mean_acceptance_length"] >= 1.0
    assert after["dflash:num_requests_running"] == 0 and after["dflash:num_requests_waiting"] == 0


def test_gauges_with_no_value_yet_read_nan(server):
    """Before the first draft the mean acceptance length (>= 1 by definition) is unknown, not 0; so is the
    automatic fallback threshold before the first drafted step measures it."""
    metrics = ServerMetrics(num_draft_tokens=7)
    Scheduler(server.pipe.engine, metrics=metrics, fallback=FallbackConfig(auto=True))
    gauges = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.exposition().decode().splitlines()
              if line and not line.startswith("#")}
    assert math.isnan(gauges["dflash:spec_decode_mean_acceptance_length"])
    assert math.isnan(gauges["dflash:fallback_threshold_acceptance_length"])
    # labelled counters are there at 0 before they first move: a rate over them reads 0, not "no data"
    for series in ('dflash:request_success_total{finished_reason="abort"}',
                   'dflash:request_rejected_total{reason="queue_full"}',
                   'dflash:request_decoder_total{decoder="plain"}'):
        assert gauges[series] == 0.0
    metrics.record_drafts([2, 0], draft_tokens=7)
    assert metrics.mean_acceptance_length._value.get() == 2.0
    fixed = ServerMetrics()
    Scheduler(server.pipe.engine, metrics=fixed, fallback=FallbackConfig(1.5))
    assert fixed.fallback_threshold._value.get() == 1.5


def test_chat_template_kwargs_reach_the_template(start_server):
    """vLLM's request field: template variables, over the server's own (--enable-thinking)."""
    live = start_server()
    live.pipe.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
        " <think></think>{% endif %}{% endif %}")
    client = live.client()

    def prompt_tokens(**extra) -> int:
        return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, temperature=0,
                                              extra_body=extra).usage.prompt_tokens

    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == prompt_tokens()
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set add_generation_prompt"):
        prompt_tokens(chat_template_kwargs={"add_generation_prompt": False})


def test_a_pipeline_with_branches_serves_the_target_alones_text(tiny_pair):
    """`dflash serve --branch-length`: concurrent greedy requests verify branches with their blocks (wider target
    forwards) and answer exactly as the target alone."""
    from dflash.serve import ServeConfig
    from dflash.serve.scheduler import SchedulerConfig

    from .conftest import LiveServer

    pipe = DFlash.from_pretrained(*map(str, tiny_pair), dtype="float32", device="cpu", block_size=4, branch_length=2)
    widths, forward = [], pipe.engine.target.forward

    def recorded(input_ids, *args, **kwargs):
        widths.append(input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)

    pipe.engine.target.forward = recorded
    server = LiveServer(pipe, ServeConfig(served_model_name=MODEL, fallback=FallbackConfig(0.0),
                                          scheduler=SchedulerConfig(max_batch_size=8, max_queue=16)))
    try:
        client = server.client()

        def ask(i: int) -> str:
            return client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        with ThreadPoolExecutor(4) as pool:
            served = list(pool.map(ask, range(4)))
    finally:
        server.stop()
    plain = DFlash.from_pretrained(*map(str, tiny_pair), no_draft=True, dtype="float32", device="cpu")
    assert served == [plain.generate(p, raw=True, max_new_tokens=12, ignore_eos=True).text for p in PROMPTS[:4]]
    assert max(widths) > 4


def test_continuous_usage_stats_give_every_chunk_its_choices_usage_so_far(server):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage is its choice's so far, rising to the
    final usage chunk's."""
    import json

    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    *pieces, final = chunks
    counts = [c["usage"]["completion_tokens"] for c in pieces]
    assert counts == sorted(counts) and counts[-1] == final["usage"]["completion_tokens"] == 12
    assert {c["usage"]["prompt_tokens"] for c in pieces} == {final["usage"]["prompt_tokens"]}
    plain = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
        **body, "stream_options": {"include_usage": True}}).text
    *pieces, final = [json.loads(line[6:]) for line in plain.splitlines() if line.startswith("data: {")]
    assert all(c["usage"] is None for c in pieces) and final["usage"]["completion_tokens"] == 12


def test_return_token_ids_gives_the_ids_each_choice_read_and_wrote(server):
    """vLLM's return_token_ids: token_ids (the answer's, as the library writes them) and prompt_token_ids, per
    completions choice and at the chat answer's top level."""
    ids = server.pipe.encode(PROMPTS[0], raw=True)
    library = server.pipe.generate(ids, raw=True, max_new_tokens=6, ignore_eos=True).output_ids
    body = {"model": MODEL, "prompt": [PROMPTS[0], PROMPTS[0]], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    assert [(c["token_ids"], c["prompt_token_ids"]) for c in answer["choices"]] == [(library, ids)] * 2
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": QUESTION, "max_tokens": 3, "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == server.pipe.encode(QUESTION)
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    refused = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_token_ids"
