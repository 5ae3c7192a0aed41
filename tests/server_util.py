"""An in-process server for tests: the app on uvicorn in a thread, on a free 127.0.0.1 port,
over an engine the test built (so its HF reference and invariants can be checked)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Iterator, NamedTuple

import uvicorn

from minijax_serve.server.app import ServerConfig, build_app


class RunningServer(NamedTuple):
    base_url: str  # http://127.0.0.1:PORT
    app: Any
    engine: Any

    def on_engine(self, fn, timeout: float = 60.0) -> Any:
        """``fn(engine)`` on the engine loop's thread (the only one that may touch it)."""
        return self.app.state.engine_loop.call(fn).result(timeout)


@contextlib.contextmanager
def running_server(engine: Any, **config: Any) -> Iterator[RunningServer]:
    """The server over ``engine`` (a ServerConfig's fields as keywords, the model "tiny")."""
    config.setdefault("served_model_name", "tiny")
    app = build_app(lambda: engine, ServerConfig(**config))
    with serve_app(app) as base_url:
        assert app.state.engine_loop.ready.wait(30)
        yield RunningServer(base_url, app, engine)


@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """``app`` on uvicorn in a thread, on a free 127.0.0.1 port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "the server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
