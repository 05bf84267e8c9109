"""Slots are freed at once: a client that disconnects mid-stream or gives up waiting, a queued request that is
cancelled; a full queue answers 429. The server here decodes slowly (one row, 20 ms a step) so requests are
still running when the test acts."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest

from dflash.decoding.engine import GenerationConfig
from dflash.serve.fallback import FallbackConfig
from dflash.serve.scheduler import Scheduler, SchedulerConfig

MODEL = "tiny"  # the served model name the fixtures use
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 400, "temperature": 0,
        "ignore_eos": True}  # ~8 s at 20 ms a step if nobody cancels it


@pytest.fixture(scope="module")
def slow(start_server):
    return start_server(slow_step_s=0.02, scheduler=SchedulerConfig(max_batch_size=1, max_queue=1))


def health(server) -> dict:
    return httpx.get(f"{server.url}/health").json()


def wait_idle(server, within_s: float = 2.0) -> float:
    """Seconds until nothing runs or waits; fails after `within_s`."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        h = health(server)
        if h["running"] == 0 and h["waiting"] == 0:
            return time.monotonic() - start
        time.sleep(0.02)
    raise AssertionError(f"slots still taken after {within_s} s: {health(server)}")


def first_content(response: httpx.Response):
    """Read up to the first text; returns the line iterator, which must stay referenced (closing it closes
    the connection, i.e. disconnects)."""
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
            return lines
    raise AssertionError("the stream ended before any content")


def grew(before: dict, after: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


ABORTED = 'dflash:request_success_total{finished_reason="abort"}'


def test_disconnect_mid_stream_frees_the_slot(slow):
    before = slow.metrics()
    with httpx.stream("POST", f"{slow.url}/v1/chat/completions", json={**LONG, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        lines = first_content(r)
        assert health(slow)["running"] == 1
        assert next(lines) is not None  # still streaming
    wait_idle(slow)
    after = slow.metrics()
    assert grew(before, after, ABORTED) == 1
    assert grew(before, after, "dflash:generation_tokens_total") < 200  # stopped long before max_tokens


def test_non_streaming_client_that_gives_up_frees_the_slot(slow):
    before = slow.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow.url}/v1/chat/completions", json=LONG, timeout=0.5)
    wait_idle(slow)
    assert grew(before, slow.metrics(), ABORTED) == 1


def test_full_queue_is_429_and_cancelled_waiters_leave(slow):
    before = slow.metrics()
    url = f"{slow.url}/v1/chat/completions"
    with httpx.Client(timeout=30) as a, httpx.Client(timeout=30) as b:
        with a.stream("POST", url, json={**LONG, "stream": True}) as running:
            lines = first_content(running)
            with b.stream("POST", url, json={**LONG, "stream": True}) as queued:
                assert queued.status_code == 200
                assert health(slow) == {"status": "ok", "running": 1, "waiting": 1}
                with pytest.raises(openai.RateLimitError) as err:
                    slow.client().chat.completions.create(**{k: v for k, v in LONG.items() if k != "ignore_eos"})
                assert err.value.status_code == 429 and err.value.body["code"] == "queue_full"
                assert err.value.response.headers["retry-after"] == "1"
            # the queued client left: its place is free at once, the running row is untouched
            deadline = time.monotonic() + 2
            while health(slow)["waiting"] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert health(slow) == {"status": "ok", "running": 1, "waiting": 0}
            assert next(lines) is not None  # the running stream goes on
    wait_idle(slow)
    after = slow.metrics()
    assert grew(before, after, 'dflash:request_rejected_total{reason="queue_full"}') == 1
    assert grew(before, after, ABORTED) == 2
    out = slow.client().chat.completions.create(model=MODEL, messages=LONG["messages"], max_tokens=3)
    assert out.usage.completion_tokens >= 1


def stream_beside_a_whole_request(server, body: dict, ready, act) -> tuple[list[str], httpx.Response]:
    """Stream `body` and, once its first text is read, send it again whole beside it; when `ready(health)` holds,
    run `act()`. Returns the stream's remaining lines and the whole request's answer."""
    url = f"{server.url}/v1/chat/completions"
    answers = {}
    asking = threading.Thread(target=lambda: answers.setdefault("whole", httpx.post(url, json=body, timeout=30)))
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json={**body, "stream": True}) as streamed:
        lines = first_content(streamed)
        asking.start()
        deadline = time.monotonic() + 5
        while not ready(health(server)):
            assert time.monotonic() < deadline, health(server)
            time.sleep(0.01)
        act()
        rest = list(lines)
    asking.join(30)
    return rest, answers["whole"]


def test_requests_in_flight_at_shutdown_get_503(start_server):
    """Ctrl-C or SIGTERM stops the decode loop: requests still decoding are told to retry (503), as new ones
    are, not that the server failed (500)."""
    server = start_server(slow_step_s=0.02, scheduler=SchedulerConfig(max_batch_size=2, max_queue=1))
    rest, whole = stream_beside_a_whole_request(server, LONG, lambda h: h["running"] == 2,
                                                server.server_state.scheduler.stop)
    assert whole.status_code == 503, whole.text
    assert whole.json()["error"]["code"] == "unavailable" and "shutting down" in whole.json()["error"]["message"]
    errors = [line for line in rest if '"error"' in line]
    assert errors and '"code":"unavailable"' in errors[0]
    assert httpx.post(f"{server.url}/v1/chat/completions", json=LONG, timeout=30).status_code == 503  # as a new one


def test_a_drain_finishes_what_was_taken_refuses_what_comes_and_stops(start_server):
    """--shutdown-timeout: at SIGTERM the requests decoding and queued finish whole; new ones and /health get 503
    (a load balancer stops routing); the decode loop then stops by itself."""
    server = start_server(slow_step_s=0.01, scheduler=SchedulerConfig(max_batch_size=1, max_queue=1))
    scheduler = server.server_state.scheduler
    short = {**LONG, "max_tokens": 40}

    def drain_and_try_more():
        scheduler.drain(30)
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=short, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "unavailable"
        said = httpx.get(f"{server.url}/health")
        assert said.status_code == 503 and said.json()["status"] == "draining"

    rest, queued = stream_beside_a_whole_request(server, short, lambda h: h["waiting"] == 1, drain_and_try_more)
    assert [line for line in rest if line][-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
    assert any('"finish_reason":"length"' in line for line in rest)
    assert queued.status_code == 200 and queued.json()["usage"]["completion_tokens"] == 40
    deadline = time.monotonic() + 5
    while scheduler._thread.is_alive():  # drained: the loop ends without a stop()
        assert time.monotonic() < deadline, "the decode loop went on after the drain"
        time.sleep(0.01)


def test_a_drain_whose_time_is_up_stops_the_rest_with_503(start_server):
    server = start_server(slow_step_s=0.02, scheduler=SchedulerConfig(max_batch_size=1, max_queue=1))
    url = f"{server.url}/v1/chat/completions"
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json={**LONG, "stream": True}) as streamed:
        lines = first_content(streamed)
        started = time.monotonic()
        server.server_state.scheduler.drain(0.3)
        rest = list(lines)
    assert time.monotonic() - started < 5  # LONG takes ~8 s undrained
    errors = [line for line in rest if '"error"' in line]
    assert errors and '"code":"unavailable"' in errors[0] and [line for line in rest if line][-1] == "data: [DONE]"


# ---- the decode loop itself, without HTTP ---------------------------------------------------------------------
def decode_with_scheduler(scheduler: Scheduler, seq, stream: bool) -> list:
    """Submit one sequence from an event loop and collect its events until done."""
    async def ask():
        request = scheduler.submit(seq, "chat/greedy", stream=stream)
        events = []
        while not events or not events[-1].done:
            events.append(await asyncio.wait_for(request.events.get(), 30))
        return events

    return asyncio.run(ask())


def test_the_caller_runs_the_decode_loop_in_its_own_thread_until_stopped(fresh_pipe):
    """`dflash serve` decodes in the thread that loaded the models (one OpenMP pool): run() must step there."""
    pipe = fresh_pipe
    stepping_threads = set()
    step = pipe.engine.step

    def recording_step(batch, choose=None):
        stepping_threads.add(threading.current_thread())
        return step(batch, choose)

    pipe.engine.step = recording_step
    scheduler = Scheduler(pipe.engine, SchedulerConfig(max_batch_size=2))
    started = threading.Event()
    decode = threading.Thread(target=scheduler.run, kwargs={"on_start": started.set})  # plays the main thread
    decode.start()
    assert started.wait(10) and scheduler.alive
    seq = pipe.engine.new_sequence([5, 6, 7], GenerationConfig(max_new_tokens=12, ignore_eos=True))
    events = decode_with_scheduler(scheduler, seq, stream=False)
    assert events[-1].finish_reason == "length" and len(seq.output_ids) == 12
    assert stepping_threads == {decode}
    scheduler.stop()
    decode.join(10)
    assert not decode.is_alive() and not scheduler.alive


def test_only_streamed_requests_get_an_event_per_step(fresh_pipe):
    pipe = fresh_pipe
    scheduler = Scheduler(pipe.engine, SchedulerConfig(max_batch_size=2))
    scheduler.start()
    try:
        config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
        streamed = pipe.engine.new_sequence([5, 6, 7], config)
        stream_events = decode_with_scheduler(scheduler, streamed, stream=True)
        whole = pipe.engine.new_sequence([5, 6, 7], config)
        whole_events = decode_with_scheduler(scheduler, whole, stream=False)
    finally:
        scheduler.stop()
    assert len(stream_events) > 2  # the prefill's token, one event per step, then done
    assert [t for e in stream_events for t in e.tokens] == streamed.output_ids
    assert len(whole_events) == 1 and whole_events[0].done and whole_events[0].finish_reason == "length"
    assert whole.output_ids == streamed.output_ids


def test_nan_logits_fail_the_batch_with_the_models_fix_and_the_server_goes_on(start_server, monkeypatch):
    """A model that overflows (NaN logits) fails what is decoding with the error that says how to load it, not
    'internal error', and the next request is served."""
    import dflash.decoding.engine as engine_module
    import dflash.decoding.verify as verify_module
    from dflash.decoding.sampling import to_probs

    server = start_server()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 1.0}
    # the target's probabilities in drafted steps (engine) and in the prefill and plain steps (verify): the block
    # policy may choose plain steps when the machine is busy, and then only the latter are taken
    for module in (engine_module, verify_module):
        monkeypatch.setattr(module, "to_probs", lambda logits, params: to_probs(logits * float("nan"), params))
    failed = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert failed.status_code == 500 and "load the model in bfloat16 or float32" in failed.json()["error"]["message"]
    monkeypatch.undo()
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_one_requests_nan_logits_fail_that_request_alone(start_server):
    """NaN logits in one row (a float16 overflow on its text) failed every request decoding in that batch; now that
    request alone fails, with the model's fix, and the one decoding beside it ends as it would have alone."""
    import dataclasses

    server = start_server(slow_step_s=0.02)
    target = server.pipe.engine.target
    original, poisoned = target.forward, []

    def forward(tokens, *args, **kwargs):  # the first forward of two rows: the second row's logits hold a NaN
        out = original(tokens, *args, **kwargs)
        if tokens.shape[0] == 2 and not poisoned:
            poisoned.append(1)
            logits = out.logits.clone()
            logits[1, :, 3] = float("nan")
            out = dataclasses.replace(out, logits=logits)
        return out

    body = {"model": MODEL, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    first = {**body, "messages": [{"role": "user", "content": "count"}], "stream": True}
    target.forward = forward
    try:
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=first, timeout=60) as r:
            lines, seen = r.iter_lines(), []
            for line in lines:  # up to the first text: decoding, so the second request joins its batch
                seen.append(line)
                if '"content":"' in line and '"content":""' not in line:
                    break
            second = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                                json={**body, "messages": [{"role": "user", "content": "hi"}]})
            seen += list(lines)
    finally:
        target.forward = original
    assert poisoned and second.status_code == 500
    assert "load the model in bfloat16 or float32" in second.json()["error"]["message"]
    chunks = [json.loads(line[6:])["choices"][0] for line in seen if line.startswith("data: {")]
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["length"]
    alone = httpx.post(f"{server.url}/v1/chat/completions", json={**first, "stream": False}, timeout=60).json()
    assert "".join(c["delta"].get("content") or "" for c in chunks) == alone["choices"][0]["message"]["content"]


def test_a_failed_rows_step_counts_as_no_draft(fresh_pipe):
    """A row whose NaN logits failed it drafted nothing the target judged: counted, its empty step read as a draft
    with nothing accepted, and (as an acceptance length of 0) pulled its workload's fallback window down."""
    import types

    engine = fresh_pipe.engine
    scheduler = Scheduler(engine, SchedulerConfig(max_batch_size=2), fallback=FallbackConfig(min_acceptance_length=1))
    rows = [engine.new_sequence([5, 6, 7], GenerationConfig(max_new_tokens=8)) for _ in range(2)]
    rows[1].fail("the model's logits are NaN")
    for seq in rows:
        scheduler._requests[id(seq)] = types.SimpleNamespace(workload="chat/greedy")
    observed = []
    scheduler.fallback.observe = lambda workload, lengths: observed.append((workload, lengths))
    batch = types.SimpleNamespace(sequences=rows, verified=4, accepted=[2, 0], produced=[3, 1], block_size=4,
                                  cut_short=False)
    scheduler._record_drafts(batch)
    metrics = scheduler.metrics
    assert metrics.num_drafts._value.get() == 1 and metrics.num_accepted_tokens._value.get() == 2
    assert observed == [("chat/greedy", [3])]


def test_a_request_whose_merge_into_the_batch_fails_gets_its_error_and_frees_its_slot(start_server):
    """A request prefilled but not merged into a batch (an error in the merge) was held by no batch, so the loop's
    error handling never finished it: its client waited forever and its slot stayed taken."""
    server = start_server()
    engine = server.pipe.engine
    merge, calls = engine.merge, []

    def failing_merge(batches):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return merge(batches)

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    engine.merge = failing_merge
    try:
        failed = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert failed.status_code == 500 and "internal error while decoding" in failed.json()["error"]["message"]
        wait_idle(server)
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    finally:
        engine.merge = merge


def test_a_burst_of_long_prompts_is_prefilled_between_decode_steps(fresh_pipe):
    """While rows decode, each turn prefills prompts of at most max_prefill_tokens (or one prompt), then steps:
    a burst of long prompts no longer holds a running stream for all their prefills."""
    pipe = fresh_pipe
    calls: list[int | None] = []  # a prompt's length per prefill, None per step
    prefill, step = pipe.engine.prefill, pipe.engine.step

    def recording_prefill(seq, proposer):
        calls.append(len(seq.prompt_ids))
        return prefill(seq, proposer)

    def recording_step(batch, choose=None):
        calls.append(None)
        return step(batch, choose)

    pipe.engine.prefill, pipe.engine.step = recording_prefill, recording_step
    scheduler = Scheduler(pipe.engine, SchedulerConfig(max_batch_size=8, max_prefill_tokens=100))

    async def burst():
        config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
        running = scheduler.submit(pipe.engine.new_sequence([5, 6, 7], config), "chat/greedy")
        await asyncio.wait_for(running.events.get(), 30)  # prefilled: it decodes from now on
        prompts = [[5 + i] * n for i, n in enumerate((60, 30, 60, 20, 150))]
        burst = [scheduler.submit(pipe.engine.new_sequence(p, GenerationConfig(max_new_tokens=4)), "chat/greedy")
                 for p in prompts]
        for request in [running, *burst]:
            while not (await asyncio.wait_for(request.events.get(), 60)).done:
                pass

    scheduler.start()
    try:
        asyncio.run(burst())
    finally:
        scheduler.stop()
    turns: list[list[int]] = [[]]  # the prompts prefilled between two steps
    for call in calls:
        if call is None:
            turns.append([])
        else:
            turns[-1].append(call)
    assert [t for t in turns if t] == [[3], [60, 30], [60, 20], [150]]  # in order, 100 a turn or one prompt


def test_disconnecting_from_several_choices_frees_them_all(slow):
    """n=2 on a server of one row and one queue place: one decodes, one waits; leaving frees both."""
    before = slow.metrics()
    with httpx.stream("POST", f"{slow.url}/v1/chat/completions", json={**LONG, "stream": True, "n": 2},
                      timeout=30) as r:
        lines = first_content(r)
        assert health(slow) == {"status": "ok", "running": 1, "waiting": 1}
        assert next(lines) is not None
    wait_idle(slow)
    assert grew(before, slow.metrics(), ABORTED) == 2


def test_a_non_streaming_client_of_several_choices_that_gives_up_frees_them_all(slow):
    before = slow.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{slow.url}/v1/chat/completions", json={**LONG, "n": 2}, timeout=0.5)
    wait_idle(slow)
    assert grew(before, slow.metrics(), ABORTED) == 2


def test_choices_that_do_not_all_fit_now_are_429_and_take_no_place(slow):
    with httpx.stream("POST", f"{slow.url}/v1/chat/completions", json={**LONG, "stream": True}, timeout=30) as r:
        lines = first_content(r)
        refused = httpx.post(f"{slow.url}/v1/chat/completions", json={**LONG, "n": 2}, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert health(slow) == {"status": "ok", "running": 1, "waiting": 0}  # not one of the two was queued
        assert next(lines) is not None  # the first request streams on
    wait_idle(slow)
