"""`dflash datagen --base-url`: the target answers through an OpenAI-compatible server (here `dflash serve` of the
tiny pair on 127.0.0.1, drafting): the records hold what a local run writes (the same prompts, prompt ids and
answers, greedy or seeded, every turn), resume alike, and a server that cannot answer is a clear error that keeps
the answers written."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from serve.conftest import LiveServer, load_pipe

from dflash.cli.main import main
from dflash.errors import UserError
from dflash.serve import ServeConfig
from dflash.serve.fallback import FallbackConfig
from dflash.training import datagen_server
from dflash.training.datagen import DatagenConfig, run_datagen

from .test_datagen import prompts, read  # noqa: F401 - the prompts fixture

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_server(tiny_pair):
    server = LiveServer(load_pipe(tiny_pair), ServeConfig(served_model_name=MODEL, fallback=FallbackConfig(0.0)))
    yield server
    server.stop()


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
    assert [r["messages"] for r in served] == [r["messages"] for r in local]  # every turn's answer, seeded alike
    assert [r["prompt_ids"] for r in served] == [r["prompt_ids"] for r in local]
    assert len(served) == 5 and any(len(r["messages"]) > 2 for r in served)  # multi-turn records among them
    tokenizer = tiny_server.pipe.tokenizer
    eos = tokenizer.eos_token_id
    for got, want in zip(served, local):
        assert tokenizer.decode(got["response_ids"], skip_special_tokens=True) == got["messages"][-1]["content"]
        assert got["finish_reason"] == want["finish_reason"]
        assert (got["response_ids"][-1:] == [eos]) == (want["response_ids"][-1:] == [eos])
        assert [t["prompt_tail_ids"] for t in got.get("earlier_turns", [])] == [
            t["prompt_tail_ids"] for t in want.get("earlier_turns", [])]


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


@pytest.mark.parametrize("answer, ends_at_eos", [
    ({"text": "May", "finish_reason": "stop", "stop_reason": None}, True),  # stopped at the end-of-text token
    ({"text": "May", "finish_reason": "stop"}, True),  # a server that does not say (OpenAI's own)
    ({"text": "May", "finish_reason": "stop", "stop_reason": "\n\n"}, False),  # at a stop string
    ({"text": "May", "finish_reason": "length", "stop_reason": None}, False),
])
def test_an_answer_that_stopped_at_the_end_of_its_text_ends_with_the_end_token(tiny_pair, tmp_path, answer,
                                                                                ends_at_eos):
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
    assert records[0]["response_ids"] == text_ids + ([tokenizer.eos_token_id] if ends_at_eos else [])
    assert records[0]["messages"][-1] == {"role": "assistant", "content": "May"}
