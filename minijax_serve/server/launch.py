"""``minijax-serve serve``: the OpenAI-compatible server on uvicorn.

The server listens at once and builds the engine on its loop's thread (``/health``: 503 until
the model is loaded, and with ``--warmup`` every step shape compiled). SIGTERM or SIGINT stops
accepting connections and aborts every request in flight (their streams end with
``finish_reason: "abort"``); the process then exits 0. A second SIGINT exits at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path
from types import FrameType
from typing import Any

GRACEFUL_SHUTDOWN_S = 5  # most seconds uvicorn waits for connections after aborting them


def add_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (the engine's are added by the CLI)."""
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only; "
                             "0.0.0.0 for every interface)")
    server.add_argument("--port", type=int, default=30000, help="port (default: 30000)")
    server.add_argument("--served-model-name", default=None,
                        help="the model name of the API: requests naming another get a 404 "
                             "(default: the --model argument)")
    server.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                             "(default: none)")
    server.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                        help="most requests submitted and not running yet; past it, new "
                             "requests get HTTP 503 (default: no limit)")
    server.add_argument("--update-weights-dir", default=None, metavar="DIR",
                        help="enable POST /update_weights_from_disk, which serves the weights "
                             "of a model directory under DIR only (default: no such endpoint)")
    server.add_argument("--warmup", action="store_true",
                        help="compile every step shape (and its samplers, under grammar masks "
                             "too when llguidance is installed) before /health answers 200")
    server.add_argument("--log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's and the server's log level; access lines at info and "
                             "debug (default: info)")


def check_args(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests must be >= 1, got {args.max_queued_requests}")
    if args.skip_tokenizer_init:
        raise ValueError("serve needs a tokenizer: drop --skip-tokenizer-init")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
    if args.update_weights_dir is not None and not Path(args.update_weights_dir).is_dir():
        raise ValueError(f"--update-weights-dir {args.update_weights_dir}: not a directory")


def run(args: argparse.Namespace, engine_config: Any) -> int:
    """Serve until SIGTERM / SIGINT; returns the exit status (1 if the engine failed to load)."""
    try:
        import uvicorn

        from minijax_serve.server.app import ServerConfig, build_app
    except ImportError as e:
        raise ValueError(f"serve needs the [serve] extra (pip install 'minijax_serve[serve]'): "
                         f"{e}") from None
    check_args(args)
    logger = logging.getLogger("minijax_serve")
    logger.setLevel(args.log_level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)

    def make_engine() -> Any:
        from minijax_serve.engine import Engine
        from minijax_serve.frontend import grammar

        engine = Engine(args.model, engine_config)
        if args.warmup:  # the samplers under grammar masks too, where the server can take them
            logging.getLogger("minijax_serve.server").info(
                "warm-up: compiled %d programs", engine.warmup(grammars=grammar.available()))
        return engine

    failed: list[BaseException] = []

    def on_load_error(err: BaseException) -> None:
        failed.append(err)
        server.should_exit = True

    config = ServerConfig(args.served_model_name or str(args.model), args.api_key,
                          args.max_queued_requests, args.update_weights_dir)
    app = build_app(make_engine, config, on_load_error)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            """Stop accepting, abort what is in flight, and exit 0 (uvicorn would re-raise the
            signal after shutting down)."""
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            loop = getattr(app.state, "engine_loop", None)
            if loop is not None:
                loop.abort_all()

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   access_log=args.log_level in ("info", "debug"),
                                   timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    server.run()
    return 1 if failed else 0
