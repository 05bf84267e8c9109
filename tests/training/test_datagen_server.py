"""`dflash datagen --base-url`: the target answers through an OpenAI-compatible server (here `dflash serve` of the
tiny pair on 127.0.0.1, drafting): the records hold what a local run writes (the same prompts, prompt ids and
answers, greedy or seeded, every turn), resume alike, and a server that cannot answer is a clear error that keeps
the answers written."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from serve.conftest import load_pipe, serving

from dflash.cli.main import main
from dflash.errors import UserError
from dflash.training import datagen_server
from dflash.training.datagen import DatagenConfig, run_datagen

from .test_datagen import prompts, read  # noqa: F401 - the prompts fixture

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_server(tiny_pair):
    with serving(tiny_pair) as server:
        yield server


def generate(tiny_pair, prompts, out, server=None, **options) -> list[dict]:  # noqa: F811
    if server is not None:
        options["base_url"] = f"{server.url}/v1"
    config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=8,
                           batch_size=3, **options)
    run_datagen(config)
    return sorted(read(out), key=lambda r: r["id"])


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 4}])
def test_a_server_writes_the_records_a_local_run_writes(tiny_pair, prompts, tmp_path, tiny_server,  # noqa: F811
                                                        sampling):
    local = generate(tiny_pair, prompts, tmp_path / "local.jsonl", **sampling)
    served = generate(tiny_pair, prompts, tmp_path / "served.jsonl", tiny_server, **sampling)
    assert served == local  # every turn's prompt and answer ids, text and finish reason, seeded alike
    assert len(served) == 5 and any(len(r["messages"]) > 2 for r in served)  # multi-turn records among them


def test_a_server_run_resumes_without_duplicates(tiny_pair, prompts, tmp_path, tiny_server):  # noqa: F811
    out = tmp_path / "served.jsonl"
    assert len(generate(tiny_pair, prompts, out, tiny_server, limit=2)) == 2
    records = generate(tiny_pair, prompts, out, tiny_server)
    assert [r["id"] for r in records] == [0, 1, 2, 3, 4]


def test_the_command_line_answers_through_a_server(tiny_pair, prompts, tmp_path, tiny_server, capsys):  # noqa: F811
    out = tmp_path / "cli.jsonl"
    assert main(["datagen", "--target", str(tiny_pair[0]), "--prompts", str(prompts), "--output", str(out),
                 "--max-new-tokens", "4", "--base-url", f"{tiny_server.url}/v1", "--model", MODEL]) == 0
    assert "wrote 5 new records" in capsys.readouterr().out and len(read(out)) == 5


@pytest.mark.parametrize("flags, says", [
    (["--model", "x"], "--model name the server of --base-url, which is not given"),
    (["--target", "", "--base-url", "http://127.0.0.1:9/v1"], "--target is empty"),
    (["--base-url", "localhost:8000"], "is not a URL"),
    (["--base-url", "http://127.0.0.1:9/v1", "--dtype", "bfloat16"], "--dtype set how the target loads here"),
    (["--base-url", "http://127.0.0.1:9/v1"], "cannot reach the server at http://127.0.0.1:9/v1"),
])
def test_server_mistakes_are_one_line_errors(tiny_pair, prompts, tmp_path, capsys, flags, says):  # noqa: F811
    assert main(["datagen", "--target", str(tiny_pair[0]), "--prompts", str(prompts), "--output",
                 str(tmp_path / "x.jsonl"), *flags]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_a_model_the_server_does_not_serve_is_named_with_those_it_does(tiny_pair, prompts, tmp_path,  # noqa: F811
                                                                       tiny_server):
    with pytest.raises(UserError, match="does not serve --model 'other'; it serves 'tiny'"):
        generate(tiny_pair, prompts, tmp_path / "x.jsonl", tiny_server, model="other")


class _Failing(http.server.BaseHTTPRequestHandler):
    """Lists a model, then fails every completion with a 503."""

    def do_GET(self):
        self._send(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self):
        self.server.posts += 1
        self._send(503, {"error": {"message": "overloaded"}})

    def _send(self, status: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_a_server_that_keeps_failing_is_tried_again_then_named(tiny_pair, prompts, tmp_path,  # noqa: F811
                                                               monkeypatch):
    monkeypatch.setattr(datagen_server, "RETRIES", 2)
    monkeypatch.setattr(datagen_server.time, "sleep", lambda s: None)
    failing = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    failing.posts = 0
    threading.Thread(target=failing.serve_forever, daemon=True).start()
    try:
        config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(tmp_path / "x.jsonl"),
                               max_new_tokens=4, batch_size=1, base_url=f"http://127.0.0.1:{failing.server_port}/v1")
        with pytest.raises(UserError, match=r"failed a request 3 times \(last: 503: overloaded\)"):
            run_datagen(config)
        assert failing.posts == 3
    finally:
        failing.shutdown()


class _Scripted(_Failing):
    """Lists a model, and answers every completion with the server's `answer` choice."""

    def do_POST(self):
        self.server.posts += 1
        self._send(200, {"object": "text_completion", "choices": [{"index": 0, **self.server.answer}]})


@pytest.mark.parametrize("answer, end", [
    ({"text": "May", "finish_reason": "stop", "stop_reason": None}, "eos"),  # stopped at the end-of-text token
    ({"text": "May", "finish_reason": "stop"}, "eos"),  # a server that does not say (OpenAI's own)
    ({"text": "May", "finish_reason": "stop", "stop_reason": 7}, [7]),  # another end token (vLLM names its id)
    ({"text": "May", "finish_reason": "stop", "stop_reason": "\n\n"}, []),  # at a stop string
    ({"text": "May", "finish_reason": "length", "stop_reason": None}, []),
    ({"text": "May", "finish_reason": "stop", "token_ids": [9, 8, 2]}, "sampled"),  # the ids it sampled, as they are
])
def test_an_answers_ids_are_the_sampled_ones_or_its_texts_and_the_end_token_it_stopped_at(tiny_pair, tmp_path,
                                                                                          answer, end):
    scripted = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    scripted.posts, scripted.answer = 0, answer
    threading.Thread(target=scripted.serve_forever, daemon=True).start()
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"prompt": "How many clips?"}) + "\n")
    try:
        records = generate(tiny_pair, one, tmp_path / "x.jsonl", base_url=f"http://127.0.0.1:{scripted.server_port}/v1")
    finally:
        scripted.shutdown()
    tokenizer = load_pipe(tiny_pair).tokenizer
    text_ids = tokenizer("May", add_special_tokens=False)["input_ids"]
    want = {"eos": text_ids + [tokenizer.eos_token_id], "sampled": [9, 8, 2]}[end] if isinstance(end, str) else (
        text_ids + end)
    assert records[0]["response_ids"] == want
    assert records[0]["messages"][-1] == {"role": "assistant", "content": "May"}


class _Picky(_Failing):
    """Lists a model, and answers completions in turn with the server's `statuses` (200: a one-word answer)."""

    def do_POST(self):
        with self.server.lock:
            status = self.server.statuses[self.server.posts % len(self.server.statuses)]
            self.server.posts += 1
        if status != 200:
            self._send(status, {"object": "error", "message": f"no ({status})"})  # vLLM's error body
        else:
            self._send(200, {"choices": [{"index": 0, "text": "May", "finish_reason": "length"}]})


def picky_server(statuses: list[int]):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Picky)
    server.posts, server.statuses, server.lock = 0, statuses, threading.Lock()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_a_prompt_the_server_refuses_is_skipped_and_the_others_answered(tiny_pair, prompts, tmp_path,  # noqa: F811
                                                                        capsys):
    picky = picky_server([200, 400])  # every second request: "too long for my context"
    try:
        out = tmp_path / "x.jsonl"
        config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=4,
                               batch_size=1, base_url=f"http://127.0.0.1:{picky.server_port}/v1")
        result = run_datagen(config)
    finally:
        picky.shutdown()
    assert result.written == len(read(out)) >= 2 and result.skipped_count + result.cut >= 2
    assert "the server refused its prompt (400: no (400))" in capsys.readouterr().err


def test_a_failure_that_stops_the_run_keeps_the_answers_finished_beside_it(tiny_pair, prompts, tmp_path,  # noqa: F811
                                                                           monkeypatch):
    monkeypatch.setattr(datagen_server.time, "sleep", lambda s: None)
    picky = picky_server([200, 200, 404])  # the third request finds no such model: the run stops
    try:
        out = tmp_path / "x.jsonl"
        config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(out), max_new_tokens=4,
                               batch_size=3, limit=3, base_url=f"http://127.0.0.1:{picky.server_port}/v1")
        with pytest.raises(UserError, match="refused a request .404: no .404..; the 2 answers written this run are"):
            run_datagen(config)
    finally:
        picky.shutdown()
    assert len(read(out)) == 2  # the two answered beside the failing one are written


def test_a_server_run_needs_the_served_targets_tokenizer(prompts, tmp_path, capsys):  # noqa: F811
    assert main(["datagen", "--prompts", str(prompts), "--output", str(tmp_path / "x.jsonl"), "--base-url",
                 "http://127.0.0.1:9/v1"]) == 2
    assert "--base-url needs --target" in capsys.readouterr().err


class _Slow(_Failing):
    """Lists a model, and takes a minute over every completion."""

    def do_POST(self):
        time.sleep(60)


def test_a_stop_does_not_wait_for_the_requests_in_flight(tiny_pair, prompts, tmp_path):  # noqa: F811
    """SIGTERM (as Ctrl-C) while every conversation waits on a slow server: the run stops at once, saying how to
    resume (it waited for each request in flight before)."""
    slow = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    slow.daemon_threads = True
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    command = [sys.executable, "-m", "dflash.cli.main", "datagen", "--target", str(tiny_pair[0]), "--prompts",
               str(prompts), "--output", str(tmp_path / "x.jsonl"), "--base-url",
               f"http://127.0.0.1:{slow.server_port}/v1", "--batch-size", "4"]
    run = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        time.sleep(4)  # the requests are in flight
        run.send_signal(signal.SIGTERM)
        err = run.communicate(timeout=30)[1]  # a minute's wait per request before
    finally:
        run.kill()
        slow.shutdown()
    assert run.returncode == 143 and "rerun the same command to resume" in err


def test_an_answer_past_the_request_timeout_is_asked_again_then_named(tiny_pair, prompts, tmp_path,  # noqa: F811
                                                                      monkeypatch):
    monkeypatch.setattr(datagen_server, "RETRIES", 1)
    monkeypatch.setattr(datagen_server.time, "sleep", lambda s: None)
    slow = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    slow.daemon_threads = True
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    try:
        config = DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(tmp_path / "x.jsonl"),
                               max_new_tokens=4, batch_size=1, limit=1, request_timeout=0.5,
                               base_url=f"http://127.0.0.1:{slow.server_port}/v1")
        started = time.perf_counter()
        with pytest.raises(UserError, match=r"failed a request 2 times"):
            run_datagen(config)
        assert time.perf_counter() - started < 30  # each try given up after 0.5 s, not the server's minute
    finally:
        slow.shutdown()
    with pytest.raises(UserError, match="--request-timeout is the seconds one answer may take"):
        DatagenConfig(target=str(tiny_pair[0]), prompts=str(prompts), output=str(tmp_path / "y.jsonl"),
                      request_timeout=-1, base_url="http://127.0.0.1:9/v1").validate()
