"""Issue 47's findings 1-4 on the tiny server: no client stalls, crashes or overloads it.
A prompt being tokenized holds no other answer back; a body past its bound is a 413; deep
JSON and lone surrogates are 400s; a 500 closes its connection and the client's next request
goes through; one request's work is bounded with a 400 naming the bound (never a 503).
``hardened_server`` (shared with tests/server/test_server_access.py) is a second server over its own
tiny engine with small bounds."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import httpx
import pytest

from minijax_serve import Engine
from tests.server_util import running_server
from tests.engine.test_engine import assert_idle_and_clean
from tests.tiny_server import CONFIG

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak  # noqa: E402

JSON = {"content-type": "application/json"}
BOUNDS = dict(max_request_body_bytes=4096, max_request_sequences=8, max_request_tokens=600,
              max_queued_requests=6, allowed_origins=("http://good.example",),
              enable_debug_endpoints=True)


@pytest.fixture(scope="session")
def hardened_server(tiny_server_dir):
    """A server with small bounds (BOUNDS) over a tiny engine of its own."""
    engine = Engine(tiny_server_dir, **CONFIG)
    with running_server(engine, **BOUNDS) as running:
        yield running


@pytest.fixture
def clean_hardened(hardened_server):
    yield
    hardened_server.on_engine(assert_idle_and_clean)


def test_health_answers_while_a_prompt_is_tokenized(tiny_server, clean_server, monkeypatch):
    """Finding 1: tokenization (here held by the test) runs off the event loop."""
    tokenizer_class = type(tiny_server.app.state.engine_loop.tokenizer)
    encode, entered, release = tokenizer_class.encode, threading.Event(), threading.Event()

    def held_encode(self, text, *args, **kwargs):
        if text == "held prompt":
            entered.set()
            release.wait(300)  # the test releases it at its end
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(tokenizer_class, "encode", held_encode)
    results = []
    held = threading.Thread(target=lambda: results.append(httpx.post(
        tiny_server.base_url + "/v1/completions", timeout=300,
        json={"prompt": "held prompt", "max_tokens": 2})))
    held.start()
    try:
        assert entered.wait(30)
        # held forever on the event loop before: no answer would come (the timeout is for a
        # loaded machine compiling the other request's first step)
        with httpx.Client(base_url=tiny_server.base_url, timeout=120) as http:
            assert http.get("/health").json() == {"status": "ok"}
            assert http.get("/v1/models").status_code == 200
            other = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert other.status_code == 200, other.text
    finally:
        release.set()
        held.join(60)
    assert results and results[0].status_code == 200


def test_a_body_past_the_bound_is_413(hardened_server):
    with httpx.Client(base_url=hardened_server.base_url, timeout=30) as http:
        big = json.dumps({"prompt": "x" * 5000})
        res = http.post("/v1/completions", content=big, headers=JSON)  # Content-Length
        assert res.status_code == 413, res.text
        assert "--max-request-body-bytes" in res.json()["error"]["message"]
        chunks = (big[i:i + 1000].encode() for i in range(0, len(big), 1000))
        res = http.post("/tokenize", content=chunks, headers=JSON)  # chunked: counted as read
        assert res.status_code == 413, res.text


def test_client_errors_are_400s(tiny_server, clean_server):
    """Finding 2: deep nesting and lone surrogates (as a client writes them: JSON escapes)."""
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as http:
        for raw, param in (
                ("[" * 2000 + "]" * 2000, None),
                ('{"prompt": ' + "[" * 101 + "]" * 101 + "}", None),
                ('{"prompt": "\\ud800"}', "prompt"),
                ('{"prompt": "x", "stop": ["\\udfff"]}', "stop"),
                ('{"prompt": "x", "\\ud800": 1}', None),
                ('{"prompt": "x", "temperature": 1e300}', "temperature"),  # float32's range
                ('{"prompt": "x", "temperature": 1e-300}', "temperature")):
            res = http.post("/v1/completions", content=raw, headers=JSON)
            assert res.status_code == 400, (raw[:40], res.text)
            assert res.json()["error"]["param"] == param
        for path, raw in (("/tokenize", '{"prompt": "a\\ud83d"}'),
                          ("/v1/chat/completions",
                           '{"messages": [{"role": "user", "content": "\\udc00"}]}')):
            res = http.post(path, content=raw, headers=JSON)
            assert res.status_code == 400 and "surrogate" in res.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code \
            == 200


def test_a_500_closes_its_connection_and_the_next_request_goes_through(
        tiny_server, clean_server, monkeypatch):
    """Finding 3: an unexpected exception (injected while the answer is built)."""
    from minijax_serve.server import responses

    def broken(self, token):
        raise RuntimeError("injected bug")

    monkeypatch.setattr(responses.TokenText, "__call__", broken)
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as http:  # one keep-alive pool
        for _ in range(3):
            res = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                     "logprobs": 1})
            assert res.status_code == 500 and res.headers["connection"] == "close"
            assert "injected bug" in res.json()["error"]["message"]
            ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert ok.status_code == 200


def test_prompts_x_n_are_bounded_by_default(tiny_server, clean_server):
    """Finding 4: 1,000 prompts x n 64 were accepted; the default bound is 256 sequences."""
    with httpx.Client(base_url=tiny_server.base_url, timeout=30) as http:
        res = http.post("/v1/completions", json={"prompt": [[1, 2]] * 300})
        error = res.json()["error"]
        assert res.status_code == 400 and error["code"] == "request_too_large"
        assert "--max-request-sequences" in error["message"] and error["param"] == "prompt"


def test_one_request_s_work_is_bounded_with_a_400(hardened_server, clean_hardened):
    """Finding 4: prompts x n, tokens, and a request larger than the whole queue: 400s naming
    the bound (not the 503 of a full queue); the engine never saw them."""
    before = _submitted(hardened_server)
    with httpx.Client(base_url=hardened_server.base_url, timeout=30) as http:
        for body, bound, param in (
                ({"prompt": [[1, 2]] * 9}, "--max-request-sequences", "prompt"),
                ({"prompt": [[1, 2]] * 7}, "--max-queued-requests", "prompt"),
                ({"prompt": [1, 2], "n": 7}, "--max-queued-requests", "n"),
                ({"prompt": [[1, 2]] * 6, "max_tokens": 100}, "--max-request-tokens", "prompt"),
                ({"messages": [{"role": "user", "content": "x"}], "n": 6, "max_tokens": 100},
                 "--max-request-tokens", "n")):
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            res = http.post(path, json=body)
            error = res.json()["error"]
            assert res.status_code == 400 and bound in error["message"], (body, error)
            assert error["code"] == "request_too_large" and error["param"] == param
        ok = http.post("/v1/completions", json={"prompt": [[1, 2]] * 6, "max_tokens": 90})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 6
    assert _submitted(hardened_server) == before + 6


def _submitted(server) -> float:
    return soak.counters(httpx.get(server.base_url + "/metrics").text)["submitted"]
