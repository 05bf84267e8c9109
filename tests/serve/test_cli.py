"""`dflash serve` as a user runs it: a separate process, answering the openai client, stopping on Ctrl-C or
SIGTERM, and saying so when its port is taken."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ctrl_c_as_in_a_terminal() -> None:
    """Run in the child before it starts: a shell starts background jobs with Ctrl-C ignored and children inherit
    that, so a suite started with `&` would otherwise see servers rightly ignore SIGINT."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def serve_process(tiny_pair, port: int, *flags: str) -> subprocess.Popen:
    target, draft = map(str, tiny_pair)
    return subprocess.Popen(
        [sys.executable, "-m", "dflash.cli.main", "serve", "--target", target, "--draft", draft, "--port", str(port),
         "--served-model-name", "tiny", "--api-key", "k", "--max-batch-size", "4", "--log-level", "warning", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_as_in_a_terminal,
    )


def wait_until_up(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "dflash serve did not come up"
        time.sleep(0.2)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_dflash_serve_process(tiny_pair, stop_signal):
    port = free_port()
    proc = serve_process(tiny_pair, port)
    try:
        wait_until_up(proc, port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=6, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics").text  # as vLLM's: no *_created series
        assert "dflash:generation_tokens_total" in metrics and "_created" not in metrics
    finally:
        proc.send_signal(stop_signal)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err


def test_dflash_serve_on_a_taken_port_says_so(tiny_pair):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = serve_process(tiny_pair, taken.getsockname()[1])
        try:
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("dflash serve kept running on a port another socket holds") from None
    assert proc.returncode != 0
    assert "is in use by another program" in err and "--port" in err and "Traceback" not in err, err


INTERRUPTED_FROM_ANOTHER_THREAD = """
import signal, sys, threading, time
from dflash.api import DFlash
from dflash.serve import ServeConfig, create_app

pipe = DFlash.from_pretrained(sys.argv[1], sys.argv[2], device="cpu")
scheduler = create_app(pipe, ServeConfig(decode_thread=False)).state.server.scheduler

def interrupt_from_this_thread():
    time.sleep(1.0)  # the decode loop is idle by now, waiting for requests
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)

threading.Thread(target=interrupt_from_this_thread).start()
try:
    scheduler.run()
except KeyboardInterrupt:
    print("interrupted")
"""


def test_idle_decode_loop_stops_when_the_signal_lands_on_another_thread(tiny_pair):
    """The kernel may hand Ctrl-C or SIGTERM to any thread (the HTTP thread, a torch worker): Python then runs
    its handler in the main thread only once that thread runs Python code again, so an idle decode loop must
    not sleep without a timeout."""
    proc = subprocess.run([sys.executable, "-c", INTERRUPTED_FROM_ANOTHER_THREAD, *map(str, tiny_pair)],
                          capture_output=True, text=True, timeout=30, preexec_fn=ctrl_c_as_in_a_terminal)
    assert proc.stdout.strip() == "interrupted", proc.stderr[-2000:]


@pytest.mark.parametrize("config", [None, "{oops", '{"hidden_size": 64}'],
                         ids=["no-config", "not-json", "no-model-type"])
def test_a_target_that_is_not_a_model_is_a_clear_error(tmp_path, capsys, config):
    """Before any model loads: one line saying what is wrong with the directory, never a traceback."""
    from dflash.cli.main import main

    if config is not None:
        (tmp_path / "config.json").write_text(config)
    assert main(["serve", "--target", str(tmp_path), "--no-draft", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_thinking_for_a_base_model_is_refused_before_serving(tiny_pair, tmp_path, capsys, monkeypatch):
    import shutil

    import uvicorn

    from dflash.cli.main import main

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: None)  # a server that starts returns at once

    base = tmp_path / "base"
    shutil.copytree(tiny_pair[0], base)
    (base / "chat_template.jinja").unlink()
    assert main(["serve", "--target", str(base), "--no-draft", "--port", "0", "--enable-thinking"]) == 2
    assert "tokenizer has no chat template (a base model) to read it: leave it out" in capsys.readouterr().err


@pytest.mark.parametrize("host, message", [("127.0.0.1", "is in use by another program; pick another with --port"),
                                           ("no-such-host.invalid", "is not an address or a name"),
                                           ("203.0.113.7", "--host must be an address of this machine")])
def test_a_taken_port_or_a_foreign_host_is_named_before_the_models_load(tiny_pair, capsys, monkeypatch, host,
                                                                        message):
    import dflash.cli.serve
    from dflash.cli.main import main

    monkeypatch.setattr(dflash.cli.serve, "load_pipeline", lambda args, **_: pytest.fail("loaded the models first"))
    target, draft = map(str, tiny_pair)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--target", target, "--draft", draft, "--host", host, "--port", str(port)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--no-draft", "--fallback-min-acceptance", "3"],
     "--fallback-min-acceptance tunes drafting, and --no-draft serves the target alone"),
    (["--no-draft", "--no-adaptive-block-size", "--fallback-window", "5"],
     "--fallback-window, --no-adaptive-block-size tune drafting"),
    (["--no-adaptive-block-size"], "drop --no-adaptive-block-size, or give --fallback-min-acceptance a number"),
    (["--no-adaptive-block-size", "--fallback-min-acceptance", "0"], None),  # allowed: goes on to load the models
    (["--no-draft"], None),
    (["--block-size", "auto"], None),  # as in dflash generate: the adaptive block size, up to the drafter's
    (["--block-size", "auto", "--no-adaptive-block-size", "--fallback-min-acceptance", "0"],
     "--block-size auto chooses each step's block size, and --no-adaptive-block-size verifies the full block"),
    (["--engine", "vllm", "--dry-run", "--attention-backend", " "], "--attention-backend is empty; give a value"),
    (["--generation-config", ""], "--generation-config is empty; give a value (auto, vllm or a directory)"),
    (["--host", ""], "--host is empty; give a value (127.0.0.1) or leave the flag out"),  # "--host  is not an address"
    (["--engine", "vllm", "--dry-run", "--draft", " "], "--draft is empty"),  # the hand-off took the embedded drafter
])
def test_drafting_flags_that_cannot_apply_are_refused_before_the_models_load(tiny_pair, capsys, monkeypatch, args,
                                                                              message):
    """With --no-draft they were ignored without a word; --no-adaptive-block-size with the automatic fallback
    threshold was refused only after the models had loaded."""
    import dflash.cli.serve
    from dflash.cli.main import main
    from dflash.errors import UserError

    def loaded(args, **_):
        raise UserError("the models would load now")

    monkeypatch.setattr(dflash.cli.serve, "load_pipeline", loaded)
    target, draft = map(str, tiny_pair)
    pair = ["--target", target] + ([] if "--no-draft" in args else ["--draft", draft])
    assert main(["serve", *pair, *args, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert (message or "the models would load now") in err and len(err.strip().splitlines()) == 1


class RequestingHTTP:
    """Plays uvicorn for `_run`: once the decode loop runs, sends one request and keeps its events."""

    def __init__(self, scheduler, seq):
        self.scheduler, self.seq = scheduler, seq
        self.started, self.should_exit = False, False
        self.events = []

    def run(self) -> None:
        import asyncio

        async def ask():
            request = self.scheduler.submit(self.seq, "chat/greedy", stream=True)
            self.started = True
            while not self.events or not self.events[-1].done:
                self.events.append(await asyncio.wait_for(request.events.get(), 10))

        try:
            asyncio.run(ask())
        except TimeoutError:
            self.events.append("lost: no event in 10 s")


@pytest.mark.parametrize("shutdown_timeout", [0.0, 30.0])
def test_a_signal_during_a_prefill_never_loses_the_request(tiny_pair, monkeypatch, shutdown_timeout):
    """SIGTERM raised KeyboardInterrupt wherever the decode thread was: inside a prefill, the request taken from
    the queue was in no batch yet, got no answer, and the server took 30 s to exit. Now a signal is acted on
    between steps: with no --shutdown-timeout the request ends with a 503, with one it finishes whole."""
    from dflash.api import DFlash
    from dflash.cli.serve import _run
    from dflash.decoding.engine import GenerationConfig
    from dflash.serve import ServeConfig, create_app

    pipe = DFlash.from_pretrained(*map(str, tiny_pair), device="cpu")
    scheduler = create_app(pipe, ServeConfig(decode_thread=False)).state.server.scheduler
    prefill = pipe.engine.prefill

    def prefill_under_a_signal(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # its handler runs here, in this (the main) thread
        return prefill(*args, **kwargs)

    monkeypatch.setattr(pipe.engine, "prefill", prefill_under_a_signal)
    seq = pipe.engine.new_sequence([5, 6, 7], GenerationConfig(max_new_tokens=12, ignore_eos=True))
    http = RequestingHTTP(scheduler, seq)
    before = signal.getsignal(signal.SIGTERM)
    start = time.monotonic()
    assert _run(http, scheduler, "test", shutdown_timeout) == 0
    assert time.monotonic() - start < 10
    last = http.events[-1]
    assert not isinstance(last, str), last
    if shutdown_timeout:
        assert (last.finish_reason, last.error) == ("length", None) and len(seq.output_ids) == 12
    else:
        assert last.unavailable and "shutting down" in last.error
    assert signal.getsignal(signal.SIGTERM) is before  # put back as it was


def test_a_sigterm_with_a_shutdown_timeout_lets_the_stream_in_flight_finish(tiny_pair):
    """`dflash serve --shutdown-timeout`: the stream being decoded at SIGTERM ends whole, and the server exits."""
    import json

    port = free_port()
    proc = serve_process(tiny_pair, port, "--shutdown-timeout", "60")
    try:
        wait_until_up(proc, port)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}], "max_tokens": 600,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer k"}) as r:
            lines = r.iter_lines()
            for line in lines:
                if '"content":"' in line:
                    break
            proc.send_signal(signal.SIGTERM)
            rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert not any("error" in chunk for chunk in rest), rest[-1]
        assert rest[-1]["usage"]["completion_tokens"] == 600
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "draining" in err and "drained: every request finished" in err, err


def test_the_server_freezes_what_it_loaded_out_of_the_collectors_sight_after_its_warm_up(tiny_pair, monkeypatch):
    """A full collection walked the ~400,000 objects of the models and libraries (0.1-0.3 s on these CPUs) while
    requests waited, and again at exit; frozen after the warm-up, they are never walked."""
    import gc

    import uvicorn

    import dflash.cli.serve
    from dflash.cli.main import main

    done = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: None)
    monkeypatch.setattr(dflash.cli.serve, "_warm_up", lambda pipe: done.append("warm-up"))
    monkeypatch.setattr(gc, "freeze", lambda: done.append("freeze"))  # the test process itself stays as it is
    main(["serve", "--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1]), "--port", "0"])
    assert done == ["warm-up", "freeze"]
