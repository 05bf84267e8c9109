"""Bench fixtures: a small data directory, the tiny pair loaded once, and a small OpenAI-compatible server
(FastAPI + uvicorn in a thread on 127.0.0.1) that decodes with the tiny pair and exposes dflash: counters."""

from __future__ import annotations

import gzip
import json
import socket
import threading
import time

import pytest

GSM8K = [
    {"question": "Tom has 3 apples and buys 2 more. How many apples?", "answer": "3 + 2 = 5\n#### 5"},
    {"question": "A box holds 4 pens. How many pens in 3 boxes?", "answer": "4 * 3 = 12\n#### 12"},
    {"question": "Sara reads 10 pages a day. How many pages in a week?", "answer": "#### 70"},
    {"question": "Half of 48 clips?", "answer": "#### 24"},
]
HUMANEVAL = [
    {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n",
     "canonical_solution": "    return a + b\n", "test": "assert add(1, 2) == 3", "entry_point": "add"},
]
MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku about clips.", "Now make it rhyme."]},
    {"question_id": 82, "category": "math", "turns": ["What is 12 times 7?", "And divided by 2?"]},
]
MATH500 = [
    {"problem": "What is $1+1$?", "answer": "2", "unique_id": "test/algebra/1.json"},
    {"problem": "Solve $x^2=4$ for $x>0$.", "answer": "2", "unique_id": "test/algebra/2.json"},
]
MBPP = [
    {"task_id": 2, "prompt": "Write a function to find the shared elements of two lists.",
     "test_list": ["assert similar_elements((3, 4), (4, 5)) == (4,)", "assert similar_elements((1,), (2,)) == ()"]},
]


def write_jsonl(path, records) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data directory laid out like ../shared/data, with a few records per dataset."""
    root = tmp_path_factory.mktemp("bench_data")
    write_jsonl(root / "gsm8k" / "test.jsonl", GSM8K)
    write_jsonl(root / "humaneval" / "HumanEval.jsonl.gz", HUMANEVAL)
    write_jsonl(root / "mt-bench" / "question.jsonl", MT_BENCH)
    write_jsonl(root / "math500" / "test.jsonl", MATH500)
    write_jsonl(root / "mbpp" / "test.jsonl", MBPP)
    return root


@pytest.fixture(scope="session")
def pipe(tiny_pair):
    from dflash.api import DFlash

    target_dir, draft_dir = tiny_pair
    return DFlash.from_pretrained(target_dir, draft_dir, device="cpu", dtype="float32")


# ---- a small OpenAI-compatible server -----------------------------------------------------------------
class SpecDecodeTally:
    """What the server itself counted, to check the bench's reading of /metrics against."""

    def __init__(self, block_size: int):
        self.drafts = self.draft_tokens = self.accepted = 0
        self.per_pos = [0] * (block_size - 1)
        self.lock = threading.Lock()

    def add(self, acceptance_lengths: list[int]) -> None:
        with self.lock:
            for n in acceptance_lengths[1:]:  # verify steps
                self.drafts += 1
                self.draft_tokens += len(self.per_pos)
                self.accepted += n - 1
                for i in range(n - 1):
                    self.per_pos[i] += 1

    def metrics_text(self, prefix: str, suffix: str) -> str:
        lines = [f"# TYPE {prefix}spec_decode_num_drafts counter",
                 f'{prefix}spec_decode_num_drafts{suffix}{{model_name="tiny"}} {float(self.drafts)}',
                 f'{prefix}spec_decode_num_drafts_created{{model_name="tiny"}} 1700000000.0',
                 f'{prefix}spec_decode_num_draft_tokens{suffix}{{model_name="tiny"}} {float(self.draft_tokens)}',
                 f'{prefix}spec_decode_num_accepted_tokens{suffix}{{model_name="tiny"}} {float(self.accepted)}']
        per_pos = f"{prefix}spec_decode_num_accepted_tokens_per_pos{suffix}"
        lines += [f'{per_pos}{{model_name="tiny",position="{i}"}} {float(c)}' for i, c in enumerate(self.per_pos)]
        return "\n".join(lines) + "\n"


def make_app(pipe, tally: SpecDecodeTally, prefix: str, suffix: str, delay_s: float = 0.0,
             stream_usage: bool = True):
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, StreamingResponse

    app = FastAPI()
    model_lock = threading.Lock()
    app.state.requests = []

    def decode(ids: list[int], body: dict) -> dict:
        with model_lock:
            out = pipe.engine.generate([ids], _config(body))[0]
        tally.add(out.stats.acceptance_lengths)
        time.sleep(delay_s)
        return {"text": out.text, "tokens": out.stats.num_output_tokens, "prompt": len(ids)}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": "tiny-dflash", "object": "model"}]}

    def streamed(result: dict, body: dict, piece) -> StreamingResponse:
        """The text in three chunks, then the usage chunk when asked for (and `stream_usage`), then [DONE]."""
        text, cut = result["text"], len(result["text"]) // 3
        chunks = [piece(part) for part in (text[:cut], text[cut:2 * cut], text[2 * cut:])]
        if stream_usage and (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({"choices": [], "usage": {"prompt_tokens": result["prompt"],
                                                    "completion_tokens": result["tokens"]}})
        events = [f"data: {json.dumps(c)}\n\n" for c in chunks] + [": keep-alive\n\n", "data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    def chat(body: dict):  # sync endpoints run in a thread pool: concurrent requests really overlap
        app.state.requests.append(body)
        result = decode(pipe.encode(body["messages"]), body)
        if body.get("stream"):
            return streamed(result, body, lambda part: {"choices": [{"index": 0, "delta": {"content": part}}]})
        return {"object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result["text"]},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": result["prompt"], "completion_tokens": result["tokens"]}}

    @app.post("/v1/completions")
    def completions(body: dict):
        app.state.requests.append(body)
        result = decode(pipe.encode(body["prompt"], raw=True), body)
        if body.get("stream"):
            return streamed(result, body, lambda part: {"choices": [{"index": 0, "text": part}]})
        return {"object": "text_completion", "model": body["model"],
                "choices": [{"index": 0, "text": result["text"], "finish_reason": "stop"}],
                "usage": {"prompt_tokens": result["prompt"], "completion_tokens": result["tokens"]}}

    @app.get("/metrics")
    def metrics():
        return PlainTextResponse(tally.metrics_text(prefix, suffix))

    return app


def _config(body: dict):
    from dflash.api import make_config

    return make_config(max_new_tokens=body.get("max_tokens", 16), temperature=body.get("temperature", 0.0),
                       seed=body.get("seed"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, app, tally: SpecDecodeTally):
        import uvicorn

        self.app, self.tally = app, tally
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> "RunningServer":
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def openai_server(pipe):
    """Start a server; call with (prefix='dflash:', suffix='_total', delay_s=0.0, stream_usage=True)."""
    running = []

    def start(prefix: str = "dflash:", suffix: str = "_total", delay_s: float = 0.0,
              stream_usage: bool = True) -> RunningServer:
        tally = SpecDecodeTally(pipe.engine.proposer.block_size)
        server = RunningServer(make_app(pipe, tally, prefix, suffix, delay_s, stream_usage), tally).__enter__()
        running.append(server)
        return server

    yield start
    for server in running:
        server.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def _no_data_dir_from_the_environment(monkeypatch):
    from dflash.bench.datasets import DATA_DIR_ENV

    monkeypatch.delenv(DATA_DIR_ENV, raising=False)


def fail_requests_of(monkeypatch, sample_id: str, error: str) -> None:
    """Every request of sample `sample_id` comes back failed with `error`; the others reach the server."""
    from dflash.bench import server

    real = server.Client.request

    async def request(self, http, messages, sample, turn, seed):
        if sample == sample_id:
            return server.RequestRecord(sample, turn, 0.0, 0, "", error)
        return await real(self, http, messages, sample, turn, seed)

    monkeypatch.setattr(server.Client, "request", request)


# ---- a scripted server: the answers a test writes, no model behind -------------------------------------
def sse(*chunks, done: bool = True):
    """A server-sent event stream of `chunks` (objects as JSON, strings as they are), then [DONE]."""
    from fastapi.responses import StreamingResponse

    events = [f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks]
    return StreamingResponse(iter(events + (["data: [DONE]\n\n"] if done else [])), media_type="text/event-stream")


def chat_chunks(*texts: str, tokens: int | None = None, finish: str = "stop", field: str = "content") -> list[dict]:
    """A chat stream's chunks: each text as a delta in `field`, the finish reason, then usage (`tokens`, default
    one per text)."""
    chunks = [{"choices": [{"index": 0, "delta": {field: t}}]} for t in texts]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    return chunks + [{"choices": [], "usage": {"completion_tokens": len(texts) if tokens is None else tokens}}]


@pytest.fixture
def scripted_server():
    """Start a server whose chat and completions requests `answer(body)` answers (a dict is sent as JSON, a
    list of chunks as a stream); its /metrics shows `metrics` (a string, or a function returning one)."""
    running = []

    def start(answer, metrics="", models=("fake",)) -> RunningServer:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, PlainTextResponse

        app = FastAPI()
        app.state.requests = []

        @app.get("/v1/models")
        def listed():
            return {"object": "list", "data": [{"id": m} for m in models]}

        @app.post("/v1/chat/completions")
        @app.post("/v1/completions")
        def answered(body: dict):
            app.state.requests.append(body)
            reply = answer(body)
            if isinstance(reply, list) and body.get("stream"):
                return sse(*reply)
            return JSONResponse(reply) if isinstance(reply, (dict, list)) else reply

        @app.get("/metrics")
        def shown():
            return PlainTextResponse(metrics() if callable(metrics) else metrics)

        server = RunningServer(app, None).__enter__()
        running.append(server)
        return server

    yield start
    for server in running:
        server.__exit__(None, None, None)
