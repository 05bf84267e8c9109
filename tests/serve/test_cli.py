"""`dflash serve` as a user runs it: a separate process, answering the openai client, stopping on Ctrl-C."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dflash_serve_process(tiny_pair):
    target, draft = map(str, tiny_pair)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash.cli.main", "serve", "--target", target, "--draft", draft, "--port", str(port),
         "--served-model-name", "tiny", "--api-key", "k", "--max-batch-size", "4", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
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
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
