"""Live servers for the serve tests: a real uvicorn server on 127.0.0.1 (a free port) in a thread."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import uvicorn

from dflash.api import DFlash
from dflash.serve import ServeConfig, create_app
from dflash.serve.fallback import FallbackConfig
from dflash.serve.scheduler import SchedulerConfig

MODEL = "tiny"


class LiveServer:
    """One app on its own pipeline (engines are never shared between decode threads)."""

    def __init__(self, pipe: DFlash, config: ServeConfig):
        self.pipe = pipe
        self.app = create_app(pipe, config)
        self.server_state = self.app.state.server
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """The exposition as {'name{labels}': value}."""
        text = httpx.get(f"{self.url}/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


@contextlib.contextmanager
def serving(pair) -> Iterator[LiveServer]:
    """A live server of a pair on disk (drafter on, fallback off), stopped at the end."""
    server = LiveServer(load_pipe(pair), ServeConfig(served_model_name=MODEL, fallback=FallbackConfig(0.0)))
    try:
        yield server
    finally:
        server.stop()


def load_pipe(tiny_pair, no_draft: bool = False) -> DFlash:
    target_dir, draft_dir = tiny_pair
    return DFlash.from_pretrained(str(target_dir), str(draft_dir), no_draft=no_draft, dtype="float32", device="cpu")


@pytest.fixture
def fresh_pipe(tiny_pair) -> DFlash:
    """The tiny pair, loaded for this test alone (it may wrap the engine)."""
    return load_pipe(tiny_pair)


@pytest.fixture(scope="session")
def start_server(tiny_pair):
    """start_server(**ServeConfig fields, slow_step_s=0) -> LiveServer; all are stopped at the end."""
    servers = []

    def start(slow_step_s: float = 0.0, **fields) -> LiveServer:
        pipe = load_pipe(tiny_pair)
        if slow_step_s:
            step = pipe.engine.step

            def slow_step(batch, choose=None):
                time.sleep(slow_step_s)
                return step(batch, choose)

            pipe.engine.step = slow_step
        fields.setdefault("served_model_name", MODEL)
        fields.setdefault("fallback", FallbackConfig(0.0))
        fields.setdefault("scheduler", SchedulerConfig(max_batch_size=8, max_queue=16))
        server = LiveServer(pipe, ServeConfig(**fields))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def server(start_server) -> LiveServer:
    """The shared server: drafter on, fallback off, 8 rows per batch."""
    return start_server()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return server.client()
