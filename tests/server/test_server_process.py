"""``python -m minijax_serve serve`` as a process: --api-key on every endpoint but /health,
and SIGTERM with requests in flight (the stream ends aborted, a whole answer is a 503, the
process exits 0)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from minijax_serve.cli import main

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--max-total-tokens", "1024", "--max-running-requests", "4", "--max-prefill-tokens", "64",
         "--min-token-bucket", "16", "--min-kv-bucket", "128", "--context-length", "128"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def process(tiny_server_dir):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "minijax_serve", "serve", "--model", str(tiny_server_dir),
         "--port", str(port), "--api-key", "sesame", "--served-model-name", "tiny",
         "--log-level", "warning", *FLAGS], cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    assert proc.poll() is None and httpx.get(base + "/health").status_code == 200
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


KEY = {"Authorization": "Bearer sesame"}
ENDPOINTS = [("GET", "/v1/models", None), ("GET", "/metrics", None),
             ("POST", "/flush_cache", None),
             ("POST", "/v1/completions", {"prompt": [3, 4], "max_tokens": 2}),
             ("POST", "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2})]


def test_api_key_guards_every_endpoint_but_health(process):
    _, base = process
    with httpx.Client(base_url=base, timeout=60) as http:
        assert http.get("/health").status_code == 200
        for method, path, body in ENDPOINTS:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
                res = http.request(method, path, json=body, headers=headers)
                assert res.status_code == 401, (path, headers)
                assert res.json()["error"]["code"] == "invalid_api_key"
            assert http.request(method, path, json=body, headers=KEY).status_code == 200, path


def _submitted(base: str) -> float:
    """The server's ``minijax_requests_submitted_total``."""
    text = httpx.get(base + "/metrics", headers=KEY, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("minijax_requests_submitted_total "))


def test_sigterm_with_requests_in_flight_exits_0(process):
    proc, base = process
    finishes: list[str | None] = []

    def stream() -> None:
        body = {"prompt": [5, 6], "max_tokens": 110, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, headers=KEY,
                          timeout=60) as res:
            for line in res.iter_lines():
                if line.startswith("data: {"):
                    if not finishes:
                        finishes.append(None)  # the first chunk: it is running
                    finishes.append(json.loads(line[6:])["choices"][0]["finish_reason"])

    whole: list[httpx.Response] = []  # a request waiting for its whole answer gets a 503

    def wait_whole() -> None:
        body = {"prompt": [7, 8], "max_tokens": 120, "ignore_eos": True}  # outlasts the stream
        whole.append(httpx.post(base + "/v1/completions", json=body, headers=KEY, timeout=60))

    before = _submitted(base)  # the module's earlier tests' requests
    threads = [threading.Thread(target=wait_whole), threading.Thread(target=stream)]
    for t in threads:  # the whole one first
        t.start()
    deadline = time.monotonic() + 60
    while not (finishes and _submitted(base) >= before + 2) and time.monotonic() < deadline:
        time.sleep(0.01)  # both requests in the engine (a client still connecting would be reset)
    assert finishes, "the stream never started"
    assert _submitted(base) == before + 2, "the whole-answer request never reached the engine"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    for t in threads:
        t.join(10)
    assert finishes[-1] == "abort"
    assert whole and whole[0].status_code == 503, whole and whole[0].text
    assert "shutting down" in whole[0].json()["error"]["message"]


def test_serve_refuses_bad_flags(capsys):
    assert main(["serve", "--skip-tokenizer-init"]) == 2
    assert "serve needs a tokenizer" in capsys.readouterr().err
    assert main(["serve", "--max-queued-requests", "0"]) == 2
    assert "--max-queued-requests must be >= 1" in capsys.readouterr().err
