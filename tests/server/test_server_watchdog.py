"""The watchdog (``--watchdog-timeout``) against an injected hang: an engine step that does
not return marks the server unhealthy (/health 503), fails what is in flight with an error
naming the timeout, refuses what comes next, and ``serve`` exits 1. Should the step return
after all, the loop aborts what the engine held: it is left idle and clean."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import minijax_serve
from minijax_serve import Engine
from minijax_serve.cli import build_parser
from minijax_serve.config.flags import engine_config_from_args
from minijax_serve.server import launch
from minijax_serve.server.app import ServerConfig, build_app
from tests.server_util import serve_app
from tests.engine.test_engine import assert_idle_and_clean
from tests.server.test_server_process import FLAGS
from tests.tiny_server import CONFIG

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak  # noqa: E402


class Hang:
    """Makes an engine's steps hang from :meth:`start` until :meth:`release`."""

    def __init__(self):
        self.hanging, self.released = threading.Event(), threading.Event()

    def start(self) -> None:
        self.hanging.set()

    def release(self) -> None:
        self.released.set()

    def wrap(self, step):
        def hung_step():
            if self.hanging.is_set():
                self.released.wait(120)
            return step()
        return hung_step


def _wait(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_hung_step_fails_what_is_in_flight_and_marks_the_server_unhealthy(tiny_server_dir):
    engine, hang, hangs = Engine(tiny_server_dir, **CONFIG), Hang(), []
    params = minijax_serve.SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine.generate([[3, 4], [3, 4]], params)  # compiled: no step outlasts the timeout
    engine.step = hang.wrap(engine.step)
    app = build_app(lambda: engine, ServerConfig("tiny", watchdog_timeout=3.0),
                    on_hang=hangs.append)
    body = {"prompt": [3, 4], "max_tokens": 8, "ignore_eos": True}
    try:
        with serve_app(app) as base, httpx.Client(base_url=base, timeout=60) as http:
            assert app.state.engine_loop.ready.wait(30)
            assert http.post("/v1/completions", json=body).status_code == 200
            hang.start()
            whole: list[httpx.Response] = []
            waiter = threading.Thread(target=lambda: whole.append(
                httpx.post(base + "/v1/completions", json=body, timeout=60)))
            waiter.start()
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as res:
                events = [ln for ln in res.iter_lines() if ln]
            waiter.join(60)
            assert len(hangs) == 1 and "--watchdog-timeout" in hangs[0]
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert "did not return within 3 s" in error["message"] and events[-1] == \
                "data: [DONE]"
            assert whole[0].status_code == 500 and "watchdog" in whole[0].json()["error"]["message"]
            health = http.get("/health")
            assert health.status_code == 503 and "unhealthy" in health.json()["error"]["message"]
            refused = http.post("/v1/completions", json=body)
            assert refused.status_code == 503 and "watchdog" in refused.text
            counts = soak.counters(http.get("/metrics").text)  # a request still in the inbox
            assert counts["error"] >= 1  # when the step hung never reached the engine
            assert counts["submitted"] == counts["length"] + counts["error"]
    finally:
        hang.release()
    loop = app.state.engine_loop
    loop._thread.join(60)
    assert not loop._thread.is_alive()
    assert_idle_and_clean(engine)  # the loop aborted what the engine held once it came back


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_exits_1_when_the_watchdog_fires(tiny_server_dir, monkeypatch):
    hang, exits, statuses = Hang(), [], []

    class HangingEngine(Engine):
        def step(self):
            return hang.wrap(super().step)()

    monkeypatch.setattr(minijax_serve.engine, "Engine", HangingEngine)  # what serve builds
    monkeypatch.setattr(launch, "hard_exit", exits.append)  # os._exit would end pytest
    port = _free_port()
    args = build_parser().parse_args(
        ["serve", "--model", str(tiny_server_dir), "--port", str(port), "--watchdog-timeout",
         "2", "--log-level", "critical", *FLAGS])
    serving = threading.Thread(target=lambda: statuses.append(
        launch.run(args, engine_config_from_args(args))))
    serving.start()
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _healthy(base))
        hang.start()
        res = httpx.post(base + "/v1/completions", json={"prompt": [3, 4], "max_tokens": 4},
                         timeout=60)
        assert res.status_code == 500 and "watchdog" in res.json()["error"]["message"]
        serving.join(60)
        assert statuses == [1] and exits == [1]
    finally:
        hang.release()
        serving.join(60)


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("flag, message", [("--watchdog-timeout=-1", "must be >= 0"),
                                           ("--max-request-body-bytes=0", "must be >= 1")])
def test_serve_refuses_bad_bounds(flag, message, capsys):
    from minijax_serve.cli import main

    assert main(["serve", flag]) == 2
    assert message in capsys.readouterr().err
