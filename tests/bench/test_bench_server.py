"""The server backend against a real HTTP server on 127.0.0.1 (see conftest: FastAPI + uvicorn + the tiny pair)."""

from __future__ import annotations

import re

import pytest
from fastapi.responses import JSONResponse

from dflash.bench.datasets import Sample
from dflash.bench.metrics import histogram_from_counters
from dflash.bench.server import (
    LevelCut,
    ServerBackend,
    ServerConfig,
    default_metrics_url,
    served_drafter,
    spec_decode_counters,
)
from dflash.errors import UserError

from .conftest import chat_chunks, fail_requests_of, sse

SAMPLES = [Sample("a", ("How many clips?",)), Sample("b", ("Weng earns",)),
           Sample("81", ("Write about clips.", "Now shorter."))]


def config(server, **kw) -> ServerConfig:
    """No warm-up unless asked for: the tests below count every request a server got."""
    defaults = {"max_new_tokens": 10, "concurrency": [1], "warmup_tokens": 0}
    return ServerConfig(base_url=server.base_url, **{**defaults, **kw})


def test_chat_load_reads_throughput_latency_and_counters(openai_server):
    server = openai_server()
    result = ServerBackend(config(server, concurrency=[2])).run_level("mixed", SAMPLES, 2)
    tally = server.tally
    assert result.errors == 0 and result.num_requests == 4 and result.num_prompts == 3
    assert result.concurrency == 2 and result.dflash_tokens_per_s > 0 and result.requests_per_s > 0
    assert set(result.dflash_latency_ms) == {"mean", "p50", "p90", "p99"}
    assert result.dflash_latency_ms["p50"] <= result.dflash_latency_ms["p99"]
    assert tally.drafts > 0
    assert result.mean_acceptance_length == pytest.approx(1 + tally.accepted / tally.drafts)
    assert sum(result.acceptance_histogram) == tally.drafts
    assert result.block_size == len(tally.per_pos) + 1
    assert result.mean_block_size == pytest.approx(1 + tally.draft_tokens / tally.drafts)
    assert result.acceptance_rate_per_position == pytest.approx([c / tally.drafts for c in tally.per_pos])
    # the model name came from /v1/models; the second mt-bench turn carried the first answer
    requests = server.app.state.requests
    assert {r["model"] for r in requests} == {"tiny-dflash"}
    two_turn = [r for r in requests if len(r["messages"]) == 3]
    assert len(two_turn) == 1 and two_turn[0]["messages"][1]["role"] == "assistant"


def test_streamed_requests_time_the_first_token_and_match_plain_answers(openai_server):
    server = openai_server(delay_s=0.01)
    streamed = ServerBackend(config(server, num_prompts=2)).run_level("gsm8k", SAMPLES[:2], 1)
    plain = ServerBackend(config(server, num_prompts=2, stream=False)).run_level("gsm8k", SAMPLES[:2], 1)
    requests = server.app.state.requests
    assert [r.get("stream", False) for r in requests] == [True, True, False, False]
    assert requests[0]["stream_options"] == {"include_usage": True}
    assert streamed.errors == 0 and streamed.dflash_output_tokens == plain.dflash_output_tokens > 0
    assert 0 < streamed.dflash_ttft_ms <= streamed.dflash_latency_ms["p99"]
    assert streamed.dflash_tpot_ms > 0
    assert plain.dflash_ttft_ms is None and plain.dflash_tpot_ms is None  # a JSON answer has no first token time


def test_streamed_text_is_compared_with_the_baseline(openai_server):
    dflash_server, plain_server = openai_server(), openai_server()
    result = ServerBackend(config(dflash_server, baseline_url=plain_server.base_url)).run_level("gsm8k", SAMPLES, 1)
    assert result.mismatches == 0 and result.baseline_ttft_ms > 0 and result.dflash_ttft_ms > 0
    assert result.num_requests == 4


def test_a_stream_without_usage_says_to_use_no_stream(openai_server):
    server = openai_server(stream_usage=False)
    with pytest.raises(UserError, match="--no-stream"):
        ServerBackend(config(server)).run_level("gsm8k", SAMPLES[:1], 1)


def test_warm_up_sends_one_short_untimed_request_to_each_server(openai_server):
    dflash_server, plain_server = openai_server(), openai_server()
    backend = ServerBackend(config(dflash_server, warmup_tokens=3, baseline_url=plain_server.base_url))
    result = backend.run_level("gsm8k", SAMPLES[:1], 1)
    backend.run_level("gsm8k", SAMPLES[:1], 1)  # once per run, not per level
    for server in (dflash_server, plain_server):
        assert [r["max_tokens"] for r in server.app.state.requests] == [3, 10, 10]
    assert sum(result.acceptance_histogram) < dflash_server.tally.drafts  # its drafts are not the load's


def test_a_failing_warm_up_is_a_user_error_before_any_load(openai_server, monkeypatch):
    server = openai_server()
    fail_requests_of(monkeypatch, "a (warm-up)", "HTTP 500: boom")
    with pytest.raises(UserError, match=r"warm-up request .* failed: HTTP 500: boom"):
        ServerBackend(config(server, warmup_tokens=4)).run_level("gsm8k", SAMPLES, 1)
    assert server.app.state.requests == []


def test_counters_are_per_load_not_since_server_start(openai_server):
    server = openai_server(prefix="vllm:", suffix="")
    backend = ServerBackend(config(server, endpoint="completions", model="tiny-dflash"))
    backend.run_level("gsm8k", SAMPLES[:1], 1)
    drafts_after_first = server.tally.drafts
    second = backend.run_level("gsm8k", SAMPLES[1:2], 1)
    assert sum(second.acceptance_histogram) == server.tally.drafts - drafts_after_first
    assert all("prompt" in r for r in server.app.state.requests)


def test_concurrency_sweep_num_prompts_and_baseline(openai_server):
    dflash_server, plain_server = openai_server(), openai_server()
    backend = ServerBackend(config(dflash_server, concurrency=[1, 2], num_prompts=4,
                                   baseline_url=plain_server.base_url))
    results = backend.run("gsm8k", SAMPLES[:2])
    assert [r.concurrency for r in results] == [1, 2]
    for r in results:
        assert r.num_requests == 4 and r.baseline_tokens_per_s > 0 and r.speedup is not None
        assert r.mismatches == 0  # same pair behind both servers, greedy
    assert len(plain_server.app.state.requests) == 8


class ArrivalLog(list):
    """A server's request list that also notes, in a list shared by several servers, which one got each request."""

    def __init__(self, name: str, order: list[str]):
        super().__init__()
        self.name, self.order = name, order

    def append(self, item) -> None:
        super().append(item)
        self.order.append(self.name)


def test_rounds_alternate_which_server_goes_first_and_take_the_median_speedup(openai_server):
    from dflash.bench.report import markdown

    dflash_server, plain_server = openai_server(), openai_server()
    order: list[str] = []
    dflash_server.app.state.requests = ArrivalLog("D", order)
    plain_server.app.state.requests = ArrivalLog("P", order)
    backend = ServerBackend(config(dflash_server, num_prompts=2, rounds=3, baseline_url=plain_server.base_url))
    result = backend.run_level("gsm8k", SAMPLES[:2], 1)
    assert order == list("DDPPPPDDDDPP")  # DFlash first, then plain first, then DFlash first
    assert result.num_requests == 6 and result.baseline_output_tokens > 0 and result.mismatches == 0
    # a round's conversations, each a distinct prompt: no "distinct" column for prompts that did not repeat
    assert result.num_prompts == 2 and result.distinct_prompts == 2 and "distinct" not in markdown([result], {})
    assert len(result.speedup_per_round) == 3
    assert result.speedup == sorted(result.speedup_per_round)[1]
    assert sum(result.acceptance_histogram) == dflash_server.tally.drafts  # counters of all three rounds
    assert "speedup range" in markdown([result], {})


def test_rounds_must_be_positive(openai_server):
    with pytest.raises(UserError, match="--rounds"):
        ServerBackend(config(openai_server(), rounds=0))


def test_duration_keeps_the_load_up(openai_server):
    server = openai_server(delay_s=0.02)
    result = ServerBackend(config(server, duration_s=1.0)).run_level("gsm8k", SAMPLES[:1], 1)
    assert result.num_requests >= 2  # one sample, cycled until the time was up (a count would stop at 1)
    assert result.num_prompts == result.num_requests and result.distinct_prompts == 1  # conversations sent


def test_a_duration_run_that_cycles_its_samples_says_what_that_does_to_a_prefix_cache(openai_server):
    """The faster server repeats the pool more, and its prefix cache answers the repeats: the comparison was
    unequal without a word, and only the DFlash side's conversations were recorded."""
    fast, slow = openai_server(delay_s=0.01), openai_server(delay_s=0.1)
    result = ServerBackend(config(fast, duration_s=1.0, baseline_url=slow.base_url)).run_level("gsm8k",
                                                                                                SAMPLES[:2], 1)
    assert result.num_prompts > max(result.baseline_num_prompts, 2) and result.distinct_prompts == 2
    [note] = [n for n in result.notes if n.startswith("--duration cycled")]
    assert (f"--duration cycled 2 distinct samples ({result.num_prompts} conversations to --base-url, the "
            f"baseline's {result.baseline_num_prompts}): a server with a prefix cache") in note


def test_unreachable_server_is_a_user_error():
    with pytest.raises(UserError, match="cannot connect"):
        ServerBackend(ServerConfig(base_url="http://127.0.0.1:9/v1", model="m")).run_level("gsm8k", SAMPLES, 1)


def test_a_wrong_api_path_or_scheme_says_what_to_fix(openai_server):
    server = openai_server()
    wrong_path = server.base_url.removesuffix("/v1") + "/v2"
    with pytest.raises(UserError, match="/v2/models answered HTTP 404: no OpenAI API answers there; --base-url is the "
                                        "API root"):
        ServerBackend(ServerConfig(base_url=wrong_path)).run_level("gsm8k", SAMPLES, 1)
    with pytest.raises(UserError, match="the warm-up request .* failed: HTTP 404.*; the server has no "
                                        "/chat/completions there: --base-url is the API root .* --endpoint "
                                        "completions"):  # with --model, the model list's 404 alone is not fatal
        ServerBackend(ServerConfig(base_url=wrong_path, model="tiny-dflash")).run_level("gsm8k", SAMPLES, 1)
    https = server.base_url.replace("http://", "https://")
    with pytest.raises(UserError, match="is the server running.*is it a plain http:// server\\? try "
                                        f"{server.base_url}"):
        ServerBackend(ServerConfig(base_url=https, model="tiny-dflash")).run_level("gsm8k", SAMPLES, 1)


def test_a_server_without_a_model_list_or_with_several_is_benchmarked_saying_so(openai_server, monkeypatch):
    """Gateways and older servers lack /models (a 404 was fatal even with --model); Ollama, LiteLLM and hosted APIs
    list many (the first was taken without a word)."""
    from dflash.bench import server as server_module

    server = openai_server()
    monkeypatch.setattr(server_module, "list_models", lambda *args: server_module.ModelList(None, 404))
    backend = ServerBackend(ServerConfig(base_url=server.base_url, model="tiny-dflash"))
    assert any("/models answered HTTP 404, so --model 'tiny-dflash' is not checked" in w for w in backend.warnings)
    assert backend.run_level("gsm8k", SAMPLES, 1).dflash_answers > 0
    monkeypatch.setattr(server_module, "list_models",
                        lambda *args: server_module.ModelList(["tiny-dflash", "other"], 200))
    backend = ServerBackend(ServerConfig(base_url=server.base_url))
    assert backend.client.model == "tiny-dflash"
    assert any("serves 2 models ['tiny-dflash', 'other']; benchmarking the first, 'tiny-dflash' (--model picks "
               "another)" in w for w in backend.warnings)


@pytest.mark.parametrize("key, message", [
    (None, "the server wants an API key; pass --api-key"),
    ("wrong", "the server rejected the key given .--api-key, or .OPENAI_API_KEY.: pass the key it was started with"),
])
def test_a_refused_key_is_told_apart_from_a_missing_one(monkeypatch, key, message):
    import httpx

    monkeypatch.setattr(httpx, "get", lambda url, **kw: httpx.Response(401, request=httpx.Request("GET", url)))
    with pytest.raises(UserError, match="answered HTTP 401: " + message):
        ServerBackend(ServerConfig(base_url="http://h/v1", api_key=key)).run_level("gsm8k", SAMPLES, 1)


def test_a_redirect_is_named_with_where_it_points(monkeypatch):
    """httpx does not follow it (a POST redirected by 301 or 302 would come back as a GET): say where to point."""
    import httpx

    def moved(url, **kw):
        return httpx.Response(301, headers={"location": "https://h/v1/models"}, request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", moved)
    with pytest.raises(UserError, match="answered HTTP 301, a redirect to https://h/v1/models: give --base-url the "
                                        "address the server answers at itself"):
        ServerBackend(ServerConfig(base_url="http://h/v1")).run_level("gsm8k", SAMPLES, 1)


def test_prometheus_parsing_of_vllm_and_dflash_names():
    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 10.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 60.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 16.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 10.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 4.0',
    ])
    counters = spec_decode_counters(text)
    assert counters.drafts == 20 and counters.accepted_tokens == 30 and counters.draft_tokens == 60
    assert counters.accepted_per_pos == [16, 10, 4]
    assert counters.mean_acceptance_length == pytest.approx(2.5)
    assert counters.mean_block_size == pytest.approx(4.0)  # 60 draft tokens over 20 drafts, plus the anchor
    # 4 drafts accepted nothing, 6 one token, 6 two, 4 all three -> lengths 1, 2, 3, 4
    assert histogram_from_counters(counters.drafts, counters.accepted_per_pos) == [0, 4, 6, 6, 4]
    assert spec_decode_counters("dflash:spec_decode_num_drafts 4\n").drafts == 4
    assert spec_decode_counters("some_other_metric 1\n") is None


def test_metrics_url_is_at_the_server_root():
    assert default_metrics_url("http://h:8000/v1") == "http://h:8000/metrics"
    assert default_metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"
    assert default_metrics_url("http://h/proxy/v1") == "http://h/proxy/metrics"


def test_a_bare_server_root_gets_v1(openai_server):
    from dflash.bench.server import api_base_url

    assert api_base_url("http://h:8000", "--base-url") == "http://h:8000/v1"
    assert api_base_url("http://h:8000/", "--base-url") == "http://h:8000/v1"
    assert api_base_url("http://h:8000/v1/", "--base-url") == "http://h:8000/v1"
    assert api_base_url("https://h/proxy/openai", "--base-url") == "https://h/proxy/openai"  # a path: as given
    for bad in ("127.0.0.1:8000", "h:8000/v1", "ftp://h/v1", "http://"):
        with pytest.raises(UserError, match="--base-url must be an http:// or https:// URL"):
            api_base_url(bad, "--base-url")
    server = openai_server()
    root = server.base_url.removesuffix("/v1")
    result = ServerBackend(ServerConfig(base_url=root, max_new_tokens=4)).run_level("gsm8k", SAMPLES[:1], 1)
    assert result.errors == 0 and result.num_requests == 1 and result.mean_acceptance_length is not None


def test_an_unreachable_baseline_fails_before_any_load(openai_server):
    server = openai_server()
    with pytest.raises(UserError) as err:
        ServerBackend(config(server, baseline_url="http://127.0.0.1:9/v1"))
    assert "cannot connect to http://127.0.0.1:9/v1/models" in str(err.value)
    assert "check --baseline-url" in str(err.value)
    assert server.app.state.requests == []


def test_a_baseline_serving_another_model_fails_before_any_load(openai_server):
    server, plain = openai_server(), openai_server()
    plain.app.router.routes = [r for r in plain.app.router.routes if getattr(r, "path", "") != "/v1/models"]

    @plain.app.get("/v1/models")
    def other_models():
        return {"object": "list", "data": [{"id": "some-other-model"}]}

    with pytest.raises(UserError, match=r"the baseline server .* serves \['some-other-model'\], not 'tiny-dflash'"):
        ServerBackend(config(server, baseline_url=plain.base_url))
    with pytest.raises(UserError, match=r"serves \['tiny-dflash'\], not 'typo'; fix --model"):
        ServerBackend(config(server, model="typo"))
    assert server.app.state.requests == [] and plain.app.state.requests == []


def test_missing_metrics_are_a_warning_up_front(openai_server):
    server = openai_server()
    backend = ServerBackend(config(server, metrics_url=server.base_url.removesuffix("/v1") + "/nothing-here"))
    [warning] = backend.warnings
    assert "/nothing-here answered HTTP 404: tau and the acceptance histogram will be missing" in warning
    assert ServerBackend(config(server)).warnings == []
    unreachable = ServerBackend(config(server, metrics_url="http://127.0.0.1:9/metrics"))
    assert "cannot read http://127.0.0.1:9/metrics (ConnectError)" in unreachable.warnings[0]


def test_a_server_that_stops_before_a_level_is_named_and_the_level_has_nothing_to_report(openai_server):
    server = openai_server()
    backend = ServerBackend(config(server))
    server.__exit__(None, None, None)
    with pytest.raises(LevelCut) as cut:
        backend.run_level("gsm8k", SAMPLES[:1], 1)
    assert cut.value.result is None
    assert isinstance(cut.value.error, UserError)
    assert re.fullmatch(r"lost the connection to .*/chat/completions \(--base-url\) during the run: did the server "
                        r"stop\?", str(cut.value.error))


def going_away_after(monkeypatch, answered: int, error: BaseException | None = None, flag: str | None = None):
    """Requests (to the server of `flag`, default both) after the first `answered` fail as when that server has
    gone (`request` raises `error`, default the UserError it raises when its connection is refused)."""
    from dflash.bench import server as server_module

    real, calls = server_module.Client.request, []

    async def request(self, *args, **kwargs):
        if flag is None or self.flag == flag:
            calls.append(1)
            if len(calls) > answered:
                raise error or UserError(f"lost the connection to it ({self.flag}) during the run: did the server "
                                         "stop?")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(server_module.Client, "request", request)


def test_a_level_cut_by_a_server_going_away_reports_what_had_finished_marked_partial(scripted_server, monkeypatch):
    """A level was reported whole or not at all: the requests it had finished were thrown away."""
    going_away_after(monkeypatch, 3)
    server = scripted_server(answer_chat)
    with pytest.raises(LevelCut) as cut:
        ServerBackend(config(server, num_prompts=8)).run_level("gsm8k", SAMPLES[:2], 1)
    result = cut.value.result
    assert result.partial and result.num_requests == 3 and result.dflash_answers == 3 and result.errors == 0
    assert result.dflash_output_tokens == 9 and result.dflash_tokens_per_s > 0
    assert result.notes[0] == ("partial: --base-url stopped answering after 3 of its requests had finished; the row "
                               "holds the requests that finished, and --base-url's tokens/s counts their tokens over "
                               "the time until then (answers still in flight are lost, so it reads low)")
    assert "did the server stop?" in str(cut.value.error)


def test_a_level_cut_in_a_later_round_stands_on_its_whole_rounds(scripted_server, monkeypatch):
    plain = scripted_server(answer_chat)
    fast = scripted_server(answer_chat)
    going_away_after(monkeypatch, 2 * 2 + 1, flag="--base-url")  # two rounds of 2 requests, then one more
    cfg = config(fast, baseline_url=plain.base_url, num_prompts=2, rounds=3)
    with pytest.raises(LevelCut) as cut:
        ServerBackend(cfg).run_level("gsm8k", SAMPLES[:2], 1)
    result = cut.value.result
    assert result.partial and result.num_requests == 4 and result.num_prompts == 2  # the whole rounds' alone
    assert len(plain.app.state.requests) == 4  # round 3 began on --base-url (rounds alternate) and stopped there
    assert result.speedup is not None and len(result.speedup_per_round) == 2 and result.mismatches == 0
    assert result.notes[0] == ("partial: --base-url stopped answering in round 3 of 3; the row stands on the 2 whole "
                               "round(s) before it, and that round's requests are left out")


def test_a_baseline_going_away_in_the_first_round_keeps_the_dflash_load_without_a_speedup(scripted_server,
                                                                                          monkeypatch):
    plain = scripted_server(answer_chat)
    fast = scripted_server(answer_chat)
    going_away_after(monkeypatch, 1, flag="--baseline-url")
    with pytest.raises(LevelCut) as cut:
        ServerBackend(config(fast, baseline_url=plain.base_url, num_prompts=2)).run_level("gsm8k", SAMPLES[:2], 1)
    result = cut.value.result
    assert result.partial and result.dflash_answers == 2 and result.baseline_output_tokens == 3
    assert result.speedup is None and result.mismatches == 0
    assert result.notes[0].startswith("partial: --baseline-url stopped answering after 1 of its requests had "
                                      "finished")
    assert result.notes[0].endswith("; the speedup is left out, as the two servers did unequal work")


def test_ctrl_c_in_a_level_reports_what_had_finished_and_interrupts(scripted_server, monkeypatch):
    going_away_after(monkeypatch, 2, KeyboardInterrupt())
    with pytest.raises(LevelCut) as cut:
        ServerBackend(config(scripted_server(answer_chat), num_prompts=4)).run_level("gsm8k", SAMPLES[:2], 1)
    assert isinstance(cut.value.error, KeyboardInterrupt)
    assert cut.value.result.dflash_answers == 2
    assert cut.value.result.notes[0].startswith("partial: interrupted (Ctrl-C) during the load on --base-url after 2 "
                                                "of its requests had finished")


def test_failed_requests_are_counted_with_the_first_error(openai_server, monkeypatch):
    fail_requests_of(monkeypatch, "b", "HTTP 500: out of memory")
    result = ServerBackend(config(openai_server())).run_level("gsm8k", SAMPLES[:2], 1)
    assert result.errors == 1 and result.first_error == "HTTP 500: out of memory" and result.num_requests == 2


def test_the_served_drafter_is_read_from_the_metrics_and_defaults_to_dflash():
    assert served_drafter('# HELP x\ndflash:drafter_info{kind="draft model"} 1.0\n') == "draft model"
    assert served_drafter('dflash:drafter_info{kind="DFlash"} 1.0\n') == "DFlash"
    assert served_drafter("vllm:spec_decode_num_drafts_total 3\n") == "DFlash"  # vLLM does not say
    assert served_drafter(None) == "DFlash"


def test_a_base_url_server_that_does_not_draft_is_a_warning_and_one_url_twice_an_error(openai_server, monkeypatch):
    """A --no-draft server on --base-url was reported as DFlash with a 'speedup' over the other server."""
    from dflash.bench import server as server_module

    dflash_server, plain = openai_server(), openai_server()
    kinds = {dflash_server.base_url.removesuffix("/v1"): "DFlash", plain.base_url.removesuffix("/v1"): "none"}
    exposition = server_module.fetch_exposition

    def fetch(url, timeout_s=10.0, api_key=None):
        text, problem = exposition(url, timeout_s, api_key)
        kind = kinds[url.removesuffix("/metrics")]
        return (text or "") + f'dflash:drafter_info{{kind="{kind}"}} 1.0\n', problem

    monkeypatch.setattr(server_module, "fetch_exposition", fetch)
    swapped = ServerBackend(config(plain, baseline_url=dflash_server.base_url))
    assert swapped.drafter == "none"
    assert any("--base-url and --baseline-url look swapped" in w for w in swapped.warnings)
    alone = ServerBackend(config(plain))
    assert any("drafts with nothing" in w and "point --base-url at a server that drafts" in w for w in alone.warnings)
    assert not any("drafts with nothing" in w
                   for w in ServerBackend(config(dflash_server, baseline_url=plain.base_url)).warnings)
    with pytest.raises(UserError, match="--baseline-url and --base-url name the same server"):
        ServerBackend(config(dflash_server, baseline_url=dflash_server.base_url.removesuffix("/v1") + "/"))


def test_a_servers_error_keeps_its_whole_message():
    """Errors were cut at 200 characters of the raw body, mid-sentence and mostly JSON punctuation."""
    import json

    from dflash.bench.server import ERROR_CHARS, _http_error

    message = "prompt (300 tokens) + max_tokens (2000) exceeds the context of 2032 tokens; " * 3
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": "max_tokens"}})
    assert _http_error(400, body) == f"HTTP 400: {message}"
    assert _http_error(502, "x" * 5000) == f"HTTP 502: {'x' * ERROR_CHARS}..."
    assert _http_error(500, '{"error": "boom"}') == 'HTTP 500: {"error": "boom"}'  # not an error object's shape


def test_answers_too_short_to_measure_decoding_are_warned_about(openai_server):
    """A chat model given raw text by --endpoint completions may end at once: ~20 tokens/s of one-token answers
    and no acceptance figures, which read as a measurement without a word."""
    from dflash.bench.metrics import BenchResult
    from dflash.bench.server import short_answers_warning

    server = openai_server()
    for endpoint, hint in (("completions", "--endpoint chat applies it"), ("chat", "check --max-new-tokens")):
        short = BenchResult(dataset="gsm8k", backend="server", num_prompts=4, num_requests=4, dflash_output_tokens=5,
                            dflash_answers=4, errors=3)  # the baseline's 3 failures do not thin the DFlash answers
        warning = short_answers_warning(short, config(server, endpoint=endpoint))
        assert "averaged 1.2 tokens, too few to measure decoding" in warning and hint in warning
    answered = ServerBackend(config(server)).run_level("gsm8k", SAMPLES[:2], 1)
    assert answered.dflash_answers == answered.num_requests == 2
    assert answered.dflash_output_tokens >= 2 * answered.num_requests
    assert short_answers_warning(answered, config(server)) is None


# ---- against a scripted server (conftest: the answers a test writes, no model behind) ------------------
def answer_chat(body, text="tok tok tok", tokens=3, finish="stop"):
    """A stream or a JSON answer of `text`, as the request asked."""
    if body.get("stream"):
        return chat_chunks(*text.split(" "), tokens=tokens, finish=finish)
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"completion_tokens": tokens}}


def one_answer(server, **kw):
    """The record of one request to `server`, as the bench sends it."""
    import asyncio

    from dflash.bench.server import Client, _one_request

    cfg = config(server, **kw)
    return asyncio.run(_one_request(Client(cfg.base_url, cfg, "fake"), SAMPLES[0]))


def test_a_level_above_its_conversations_and_a_level_without_drafts_are_noted(scripted_server):
    """--concurrency 4 with 2 conversations was reported as 4 in flight; a server whose fallback decoded plainly
    showed tau '-' without a word."""
    server = scripted_server(answer_chat, metrics="dflash:spec_decode_num_drafts_total 5\n")
    result = ServerBackend(config(server, num_prompts=2)).run_level("gsm8k", SAMPLES[:2], 4)
    assert result.mean_acceptance_length is None
    [crowded, plain] = result.notes
    assert "--concurrency 4 is above the level's 2 conversation(s)" in crowded and "--num-prompts 4" in crowded
    assert "did no drafted step" in plain and "did not move" in plain and "fallback" in plain


@pytest.mark.parametrize("max_new_tokens,why", [(1, "raise --max-new-tokens"), (10, "try --endpoint chat")])
def test_answers_of_one_token_measure_no_decoding_and_give_no_speedup(scripted_server, max_new_tokens, why):
    """A ratio of two prefills was shown as the speedup (and drawn in the speedup plot), with a note blaming the
    fallback; the local backend already left it out."""
    one_token = lambda body: answer_chat(body, text="tok", tokens=1)  # noqa: E731
    fast = scripted_server(one_token, metrics="dflash:spec_decode_num_drafts_total 5\n")
    base = scripted_server(one_token)
    result = ServerBackend(config(fast, num_prompts=2, max_new_tokens=max_new_tokens,
                                  baseline_url=base.base_url)).run_level("gsm8k", SAMPLES[:2], 1)
    assert result.baseline_tokens_per_s and result.dflash_tokens_per_s and result.speedup is None
    [note] = [n for n in result.notes if "first token" in n]
    assert "no decoding was measured and there is no speedup ('-')" in note and why in note
    assert not any("fallback" in n for n in result.notes)


def test_failed_requests_are_counted_per_server_and_leave_the_speedup_out(scripted_server):
    from dflash.bench.report import markdown, warnings

    def flaky(body):  # the baseline fails one of the two prompts
        if "Weng" in body["messages"][-1]["content"]:
            return JSONResponse({"error": {"message": "out of memory"}}, status_code=500)
        return answer_chat(body)

    server, baseline = scripted_server(answer_chat), scripted_server(flaky)
    result = ServerBackend(config(server, baseline_url=baseline.base_url, rounds=2)).run_level("g", SAMPLES[:2], 1)
    assert (result.errors, result.baseline_errors) == (0, 2)
    assert result.baseline_first_error == "HTTP 500: out of memory"
    assert result.speedup is None and result.speedup_per_round == [] and result.baseline_tokens_per_s > 0
    said = warnings([result])
    assert any("2 request(s) to the baseline server (--baseline-url) failed" in w for w in said)
    assert any("speedup left out ('-'): 0 request(s) to --base-url and 2 to --baseline-url failed" in w for w in said)
    assert "| - |" in markdown([result], {}) and "base errors" in markdown([result], {})


@pytest.mark.parametrize("stream", [True, False])
def test_reasoning_text_counts_as_answer_text(scripted_server, stream):
    """vLLM / SGLang with --reasoning-parser send the thinking in reasoning_content (or reasoning): it was dropped,
    so the first token came late and two servers' answers compared equal on the content alone."""
    def reasoning(body):
        if body.get("stream"):
            return chat_chunks("think ", "more ", field="reasoning_content")[:2] + chat_chunks(
                "hmm ", field="reasoning")[:1] + chat_chunks("42", tokens=4)
        return {"choices": [{"index": 0, "message": {"reasoning_content": "think more hmm ", "content": "42"}}],
                "usage": {"completion_tokens": 4}}

    server = scripted_server(reasoning)
    record = one_answer(server, stream=stream)
    assert record.error is None and record.text == "think more hmm 42"
    assert (record.ttft_s is not None) == stream
    # a second turn (mt-bench) sends back the content alone, as clients do: not the reasoning
    import asyncio

    from dflash.bench.server import Client

    cfg = config(server, stream=stream)
    first, second = asyncio.run(_conversation(Client(cfg.base_url, cfg, "fake"), SAMPLES[2]))
    assert first.text == second.text == "think more hmm 42"
    assert server.app.state.requests[-1]["messages"][1] == {"role": "assistant", "content": "42"}


async def _conversation(client, sample):
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        return await client.conversation(http, sample, 0)


def test_one_server_spelled_two_ways_is_refused_and_a_drafting_baseline_warned_of(scripted_server, monkeypatch):
    from dflash.bench.server import same_server

    assert same_server("http://localhost:8000", "http://127.0.0.1:8000/v1/")
    assert same_server("http://LOCALHOST:80/v1", "http://127.0.0.1/v1")
    assert not same_server("http://localhost:8000/v1", "http://127.0.0.1:8001/v1")
    assert not same_server("http://127.0.0.1:8000/a/v1", "http://127.0.0.1:8000/b/v1")  # a proxy's two mounts
    # two services behind one load balancer share its address and are told apart by name
    monkeypatch.setattr("dflash.bench.server._addresses", lambda host: {"203.0.113.7"})
    assert not same_server("https://dflash.example/v1", "https://plain.example/v1")
    assert same_server("https://dflash.example/v1", "https://DFLASH.example:443/v1/")
    monkeypatch.undo()
    server = scripted_server(answer_chat, metrics="dflash:spec_decode_num_drafts_total 1\n")
    with pytest.raises(UserError, match="--baseline-url and --base-url name the same server"):
        ServerBackend(config(server, baseline_url=server.base_url.replace("127.0.0.1", "localhost")[:-3]))
    drafting = scripted_server(answer_chat, metrics="vllm:spec_decode_num_drafts_total 3\n")
    [warning] = ServerBackend(config(server, baseline_url=drafting.base_url)).warnings
    assert "the --baseline-url server's metrics" in warning and "say it drafts" in warning
    no_draft = 'dflash:drafter_info{kind="none"} 1\ndflash:spec_decode_num_drafts 0\n'  # dflash serve --no-draft
    plain = scripted_server(answer_chat, metrics=no_draft)
    assert ServerBackend(config(server, baseline_url=plain.base_url)).warnings == []


def test_answers_capped_below_max_new_tokens_are_noted_once(scripted_server):
    """dflash serve and vLLM cap max_tokens at the model's generation_config max_new_tokens (300 for the embedded
    pair): answers ended at 300 tokens under --max-new-tokens 2048, unsaid."""
    server = scripted_server(lambda body: answer_chat(body, finish="length"),
                             metrics="dflash:spec_decode_num_drafts_total 0\n")
    backend = ServerBackend(config(server))
    first, second = (backend.run_level("gsm8k", SAMPLES[:1], c) for c in (1, 2))
    [capped] = [n for n in first.notes if "ended for length" in n]
    assert "at 3 tokens, short of --max-new-tokens 10" in capped and "--generation-config vllm" in capped
    assert not any("ended for length" in n for n in second.notes)  # said once


def test_the_whole_request_is_timed_out_and_the_flag_named(scripted_server):
    """--request-timeout bounded each wait for bytes alone: a stream trickling forever was never cut, and a cut
    one said `ReadTimeout: `."""
    import asyncio

    from fastapi.responses import StreamingResponse

    async def trickle():
        for _ in range(50):
            yield 'data: {"choices": [{"index": 0, "delta": {"content": "tok "}}]}\n\n'
            await asyncio.sleep(0.05)

    server = scripted_server(lambda body: StreamingResponse(trickle(), media_type="text/event-stream"))
    record = one_answer(server, timeout_s=0.3, timeout_flag="--timeout-s")
    assert record.error == ("no whole answer within --timeout-s 0.3 s; raise --timeout-s for longer answers or a "
                            "slower server")
    assert record.latency_s < 1.5


@pytest.mark.parametrize("stream, reply, error", [
    (True, "42", "the server sent a stream event that is not a JSON object: 42"),  # `data: 42`
    (True, chat_chunks("a", "b")[:-1] + [{"choices": [], "usage": {"completion_tokens": None}}],
     'the stream\'s usage gave no count of output tokens (usage: {"completion_tokens": null})'),
    (False, [1, 2], "the server sent an answer that is not a JSON object: [1, 2]"),
    (False, {"choices": [{"message": {"content": "a"}}], "usage": {"completion_tokens": None}},
     "the answer's usage gave no count of output tokens"),
])
def test_malformed_replies_are_the_requests_error_not_a_crash(scripted_server, stream, reply, error):
    record = one_answer(scripted_server(lambda body: sse(reply) if reply == "42" else reply), stream=stream)
    assert record.error is not None and error in record.error


def test_a_metrics_position_that_is_no_number_is_left_out_with_a_warning(scripted_server):
    from dflash.bench.server import spec_decode_counters

    text = ('vllm:spec_decode_num_drafts_total 4\nvllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 3\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="x"} 1\n')
    assert spec_decode_counters(text).accepted_per_pos == [3]
    [warning] = ServerBackend(config(scripted_server(answer_chat, metrics=text))).warnings
    assert "position=['x'], not draft positions 0, 1, ...: those are left out of the acceptance histogram" in warning


def test_a_base_model_refusing_chat_is_told_to_use_completions(scripted_server):
    refusal = JSONResponse({"error": {"message": "this model's tokenizer has no chat template (a base model), so "
                                                 "chat messages cannot be turned into its prompt; send the text to "
                                                 "/v1/completions instead"}}, status_code=400)
    server = scripted_server(lambda body: refusal)
    with pytest.raises(UserError, match="warm-up request .* failed: HTTP 400: .*benchmark it with --endpoint "
                                        "completions"):
        ServerBackend(config(server, warmup_tokens=2)).run_level("gsm8k", SAMPLES[:1], 1)


def test_a_token_count_that_is_no_finite_number_is_no_count():
    """json.loads reads a server's Infinity as a float, and int(inf) raised OverflowError: a traceback."""
    from dflash.bench.server import _completion_tokens

    assert _completion_tokens({"completion_tokens": float("inf")}) is None
    assert _completion_tokens({"completion_tokens": float("nan")}) is None
    assert _completion_tokens({"completion_tokens": 7}) == 7 and _completion_tokens({"completion_tokens": -1}) is None


def test_counters_that_go_backwards_or_cannot_be_read_during_a_level_are_noted(scripted_server):
    """A restart between scrapes (or metrics from another replica), or a metrics endpoint that stops answering,
    left tau '-' without a word."""
    scrapes = []

    def restarting():
        scrapes.append(1)
        drafts = 10 if len(scrapes) < 3 else 2  # the start's check, the level's first scrape, then a restart
        return f"vllm:spec_decode_num_drafts_total {drafts}\nvllm:spec_decode_num_accepted_tokens_total {drafts}\n"

    server = scripted_server(answer_chat, metrics=restarting)
    result = ServerBackend(config(server)).run_level("gsm8k", SAMPLES[:1], 1)
    assert result.mean_acceptance_length is None
    assert any("spec-decode counters at " in n and "went backwards during this level" in n for n in result.notes), (
        result.notes, len(scrapes))

    def dying():
        scrapes.append(1)
        if len(scrapes) > 2:  # the start's check and the level's first scrape answer
            raise RuntimeError("the metrics endpoint stopped")
        return "vllm:spec_decode_num_drafts_total 4\n"

    scrapes.clear()
    server = scripted_server(answer_chat, metrics=dying)
    result = ServerBackend(config(server)).run_level("gsm8k", SAMPLES[:1], 1)
    assert any("could not be read around this level" in n and "answered HTTP 500" in n for n in result.notes)


def test_metrics_behind_the_api_key_are_read_with_it(monkeypatch):
    import httpx

    from dflash.bench.server import fetch_exposition

    def get(url, headers=None, **kw):
        allowed = (headers or {}).get("Authorization") == "Bearer sekrit"
        return httpx.Response(200 if allowed else 401, text="vllm:spec_decode_num_drafts_total 1\n",
                              request=httpx.Request("GET", url))

    monkeypatch.setattr(httpx, "get", get)
    assert fetch_exposition("http://h/metrics", api_key="sekrit") == ("vllm:spec_decode_num_drafts_total 1\n", None)
    assert fetch_exposition("http://h/metrics") == (None, "http://h/metrics answered HTTP 401")


def test_swapped_servers_and_other_engines_mismatches_are_told_what_they_likely_are(scripted_server):
    plain = scripted_server(answer_chat, metrics="")  # e.g. vLLM without a speculative config
    drafting = scripted_server(lambda body: answer_chat(body, text="other words here"),
                               metrics="vllm:spec_decode_num_drafts_total 3\n")
    warnings = ServerBackend(config(plain, baseline_url=drafting.base_url)).warnings
    assert any("--base-url and --baseline-url look swapped" in w for w in warnings)
    unread = ServerBackend(config(plain, baseline_url=drafting.base_url,  # its metrics unread: nothing says swapped
                                  metrics_url=plain.base_url.removesuffix("/v1") + "/nothing-here")).warnings
    assert not any("look swapped" in w for w in unread) and any("two drafting servers" in w for w in unread)
    result = ServerBackend(config(drafting, baseline_url=plain.base_url)).run_level("gsm8k", SAMPLES[:1], 1)
    assert result.mismatches == 1
    assert any("other engines' (vLLM, SGLang" in n and "--concurrency 1" in n for n in result.notes)


@pytest.mark.parametrize("status, key, hint", [
    (401, None, "the server wants an API key: pass --api-key"),
    (403, "wrong", "the server refused the key given"),
])
def test_a_warm_up_refused_for_its_key_says_so(scripted_server, status, key, hint):
    server = scripted_server(lambda body: JSONResponse({"detail": "Unauthorized"}, status_code=status))
    with pytest.raises(UserError, match=f"warm-up request .* failed: HTTP {status}.*; {hint}"):
        ServerBackend(config(server, warmup_tokens=2, api_key=key)).run_level("gsm8k", SAMPLES[:1], 1)


@pytest.mark.parametrize("stream", [True, False])
def test_a_full_server_is_waited_out_for_its_retry_after_and_the_waits_noted(scripted_server, stream):
    """A 429 (dflash serve: every batch slot and queue place taken) counted as a failed request and the load went
    on at full rate; a client waits its Retry-After and sends the request again."""
    turned = []

    def full_twice(body):
        if len(turned) < 2:
            turned.append(body)
            return JSONResponse({"error": {"message": "queue full"}}, status_code=429,
                                headers={"Retry-After": "0.2"})
        return answer_chat(body)

    server = scripted_server(full_twice, metrics="dflash:spec_decode_num_drafts_total 0\n")
    result = ServerBackend(config(server, stream=stream, warmup_tokens=0)).run_level("gsm8k", SAMPLES[:1], 1)
    assert len(turned) == 2 and result.errors == 0 and result.dflash_answers == 1
    assert result.dflash_latency_ms["p50"] >= 400  # the two waits are the request's latency
    [note] = [n for n in result.notes if "HTTP 429" in n]  # not "429": another note names the server's port
    assert "--base-url: 1 request(s) were turned away with HTTP 429 (2 time(s) in all)" in note
    assert "--max-queue" in note


def test_a_server_full_past_the_request_timeout_is_that_requests_error(scripted_server):
    server = scripted_server(lambda body: JSONResponse({"error": {"message": "queue full"}}, status_code=429))
    record = one_answer(server, timeout_s=1.5)
    assert record.error.startswith("the server turned it away with HTTP 429 ")
    assert record.error.endswith(" time(s) within --request-timeout 1.5 s and never took it (full all along): lower "
                                 "--concurrency to what the server takes at once (dflash serve: --max-batch-size plus "
                                 "--max-queue), or give it room")
    assert record.turned_away >= 1 and record.latency_s < 3


def test_a_full_server_saying_retry_after_0_is_asked_again_ever_more_slowly(scripted_server):
    """Retry-After: 0 was taken at its word: one request was sent 1,616 times in 3 s."""
    server = scripted_server(lambda body: JSONResponse({"error": {"message": "queue full"}}, status_code=429,
                                                       headers={"Retry-After": "0"}))
    record = one_answer(server, timeout_s=2.0)
    # waits of 0.1, 0.2, 0.4, 0.8 s fill 1.5 s: five tries at most in 2 s (the next wait is 1.6 s)
    assert 3 <= len(server.app.state.requests) <= 5 and record.turned_away == len(server.app.state.requests)


def test_retry_after_reads_seconds_and_dates_and_bounds_them():
    from dflash.bench.server import DEFAULT_RETRY_AFTER_S, MAX_RETRY_AFTER_S, retry_after_s

    assert retry_after_s("2") == 2.0 and retry_after_s(" 0.5 ") == 0.5
    assert retry_after_s(None) == retry_after_s("soon") == retry_after_s("nan") == DEFAULT_RETRY_AFTER_S
    assert retry_after_s("-3") == 0.0 and retry_after_s("3600") == MAX_RETRY_AFTER_S
    now = 1_700_000_000.0  # Tue, 14 Nov 2023 22:13:20 GMT
    assert retry_after_s("Tue, 14 Nov 2023 22:13:25 GMT", now=now) == pytest.approx(5.0)
    assert retry_after_s("Tue, 14 Nov 2023 22:13:25", now=now) == DEFAULT_RETRY_AFTER_S  # no zone: unreadable


def test_a_level_of_few_drafted_steps_says_its_tau_and_speedup_rest_on_too_little(scripted_server):
    scrapes = []

    def counters():  # 7 drafted steps between one scrape and the next
        scrapes.append(1)
        return f"dflash:spec_decode_num_drafts_total {7 * len(scrapes)}\n"

    server = scripted_server(answer_chat, metrics=counters)
    result = ServerBackend(config(server, warmup_tokens=0)).run_level("gsm8k", SAMPLES[:1], 1)
    [note] = [n for n in result.notes if "verify steps" in n]
    assert note == ("only 7 verify steps (3 output tokens) were measured, too few for a steady tau or speedup: raise "
                    "--num-prompts (or --duration) or --max-new-tokens")  # --max-samples sends a server no more


@pytest.mark.parametrize("flag, url", [("--base-url", "http://[::1"), ("--base-url", "http://127.0.0.1:abc/v1"),
                                       ("--metrics-url", "http://[::1"), ("--metrics-url", "http://127.0.0.1:x/m"),
                                       ("--baseline-url", "http://127.0.0.1:99999/v1")])
def test_a_url_that_is_no_url_is_a_user_error_naming_its_flag(flag, url):
    """ValueError: Invalid IPv6 URL and httpx.InvalidURL: Invalid port came out as tracebacks."""
    fields = {"base_url": "http://127.0.0.1:8000/v1", {"--base-url": "base_url", "--metrics-url": "metrics_url",
                                                       "--baseline-url": "baseline_url"}[flag]: url}
    with pytest.raises(UserError, match=rf"^{flag} '{re.escape(url)}' is no URL \(.+\): give one like http://"):
        ServerConfig(**fields)


def test_a_query_in_the_api_root_stays_after_each_endpoints_path(scripted_server):
    """http://host/v1?x=1 became http://host/v1?x=1/models: a proxy's api-version query broke every request."""
    from dflash.bench.server import api_url

    assert api_url("http://h:1/v1?api-version=2", "/models") == "http://h:1/v1/models?api-version=2"
    assert api_url("http://h:1/v1/", "/completions") == "http://h:1/v1/completions"
    server = scripted_server(answer_chat)
    cfg = ServerConfig(base_url=server.base_url + "?api-version=2", max_new_tokens=10, warmup_tokens=0)
    assert ServerBackend(cfg).run_level("gsm8k", SAMPLES[:1], 1).dflash_answers == 1


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("text, tokens, error", [
    ("tok tok", 100000, "the server counted 100000 output tokens (usage.completion_tokens) for an answer of at most "
                        "max_tokens 10: its usage is wrong"),
    ("tok tok", 0, "the server counted 0 output tokens (usage.completion_tokens) for an answer with text"),
])
def test_a_token_count_the_request_rules_out_is_the_requests_error(scripted_server, stream, text, tokens, error):
    """100000 tokens for max_tokens 32 gave 1,926,659 tok/s and no warning; 0 tokens for text, 0 tok/s."""
    record = one_answer(scripted_server(lambda body: answer_chat(body, text, tokens)), stream=stream)
    assert record.error is not None and record.error.startswith(error) and record.output_tokens == 0
    assert one_answer(scripted_server(lambda body: answer_chat(body, "", 0)), stream=stream).error is None


def test_a_duration_up_before_the_first_request_is_a_user_error(scripted_server):
    """--duration 1e-7 reported a level of 0 prompts at 0.0 tok/s, and exit code 0."""
    with pytest.raises(UserError, match=r"no request to .* \(--base-url\) was sent: the level's --duration 1e-07 s "
                                        r"was up before the first; give a longer --duration"):
        ServerBackend(config(scripted_server(answer_chat), duration_s=1e-7)).run_level("gsm8k", SAMPLES[:1], 1)


@pytest.mark.parametrize("stream", [True, False])
def test_json_nested_too_deep_to_read_is_the_requests_error(scripted_server, stream):
    """RecursionError escaped every handler as a traceback."""
    from fastapi.responses import PlainTextResponse, StreamingResponse

    deep = "[" * 100000 + "]" * 100000
    reply = (StreamingResponse(iter([f"data: {deep}\n\n"]), media_type="text/event-stream") if stream
             else PlainTextResponse(deep, media_type="application/json"))
    record = one_answer(scripted_server(lambda body: reply), stream=stream)
    assert record.error.startswith(f"the server sent {'a stream event' if stream else 'an answer'} that nests too "
                                   "deep to read: ")


def test_a_body_that_is_no_json_says_what_came(scripted_server):
    from fastapi.responses import PlainTextResponse

    record = one_answer(scripted_server(lambda body: PlainTextResponse("Service Unavailable")), stream=False)
    assert record.error.startswith("the server sent an answer that is no JSON (Expecting value: line 1 column 1 "
                                   "(char 0)): 'Service Unavailable'")


def test_a_streamed_request_answered_without_events_says_what_came_instead(scripted_server):
    """It was blamed on a missing usage chunk."""
    from fastapi.responses import PlainTextResponse

    record = one_answer(scripted_server(lambda body: PlainTextResponse("hello there")), stream=True)
    assert record.error == ("the server answered the streamed request with text/plain; charset=utf-8, beginning "
                            "'hello there': no server-sent event (data: ...) came; a server that does not stream is "
                            "benchmarked with --no-stream")


def test_a_stream_that_never_ends_after_the_whole_answer_says_so(scripted_server):
    """A stream that sent its finish reason and usage, then hung, was blamed on long answers or a slow server."""
    import asyncio
    import json as json_module

    from fastapi.responses import StreamingResponse

    async def hang():
        for chunk in chat_chunks("a", "b"):
            yield f"data: {json_module.dumps(chunk)}\n\n"
        await asyncio.sleep(30)

    server = scripted_server(lambda body: StreamingResponse(hang(), media_type="text/event-stream"))
    record = one_answer(server, timeout_s=0.5)
    assert record.error == ("the stream sent its finish reason and usage and then neither 'data: [DONE]' nor the end "
                            "of the response within --request-timeout 0.5 s: the server does not close its streams "
                            "(run with --no-stream)")


def test_every_turn_is_sent_with_a_seed_of_its_own_the_same_to_both_servers(scripted_server):
    plain, fast = scripted_server(answer_chat), scripted_server(answer_chat)
    samples = [Sample("81", ("Hi.", "More.")), Sample("82", ("Yes.", "No."))]
    ServerBackend(config(fast, baseline_url=plain.base_url, temperature=0.7)).run_level("mt-bench", samples, 1)
    seeds = [body["seed"] for body in fast.app.state.requests]
    assert seeds == [body["seed"] for body in plain.app.state.requests] and len(set(seeds)) == 4
