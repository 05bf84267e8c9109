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


def serve_process(tiny_pair, port: int) -> subprocess.Popen:
    target, draft = map(str, tiny_pair)
    return subprocess.Popen(
        [sys.executable, "-m", "dflash.cli.main", "serve", "--target", target, "--draft", draft, "--port", str(port),
         "--served-model-name", "tiny", "--api-key", "k", "--max-batch-size", "4", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_dflash_serve_process(tiny_pair, stop_signal):
    port = free_port()
    proc = serve_process(tiny_pair, port)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "dflash serve did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=6, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
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
    assert "could not listen" in err and "--port" in err and "Traceback" not in err, err
