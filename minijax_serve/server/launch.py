"""``minijax-serve serve``: the OpenAI-compatible server on uvicorn.

The server listens at once and builds the engine on its loop's thread (``/health``: 503 until
the model is loaded, and with ``--warmup`` every step shape compiled). SIGTERM or SIGINT stops
accepting connections and aborts every request in flight (their streams end with
``finish_reason: "abort"``); the process then exits 0. A second SIGINT exits at once. When the
watchdog finds a step hung (``--watchdog-timeout``), the server stops the same way and the
process exits 1 at once, without waiting for the engine's thread.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from minijax_serve.server.server_config import (API_KEY_ENV, MAX_REQUEST_BODY_BYTES,
                                                MAX_REQUEST_SEQUENCES, MAX_REQUEST_TOKENS,
                                                WATCHDOG_TIMEOUT_S, ServerConfig,
                                                resolve_api_key)

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
                             "(default: none). Every local user sees a flag in `ps`: prefer "
                             f"--api-key-file or ${API_KEY_ENV}")
    server.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="the API key: the first line of PATH")
    server.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                        help="most sequences (prompts x n) submitted and not running yet; past "
                             "it, new requests get HTTP 503 (default: no limit)")
    server.add_argument("--max-request-body-bytes", type=int, default=MAX_REQUEST_BODY_BYTES,
                        metavar="N", help="largest request body; past it HTTP 413 (default: "
                                          f"{MAX_REQUEST_BODY_BYTES})")
    server.add_argument("--max-request-sequences", type=int,
                        default=MAX_REQUEST_SEQUENCES, metavar="N",
                        help="most sequences (prompts x n) one request may queue; past it "
                             f"HTTP 400 (default: {MAX_REQUEST_SEQUENCES})")
    server.add_argument("--max-request-tokens", type=int, default=MAX_REQUEST_TOKENS,
                        metavar="N", help="most tokens one request may queue: (prompt + "
                                          "max_tokens) x n over its prompts; past it HTTP 400 "
                                          f"(default: {MAX_REQUEST_TOKENS})")
    server.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                        help="browser origins allowed to call the server (CORS), '*' for any; "
                             "others get HTTP 403 (default: none but the server's own)")
    server.add_argument("--watchdog-timeout", type=float, default=WATCHDOG_TIMEOUT_S,
                        metavar="S", help="an engine step that does not return within S "
                                          "seconds fails the requests in flight and exits 1; 0 "
                                          f"turns it off (default: {WATCHDOG_TIMEOUT_S:g})")
    server.add_argument("--enable-debug-endpoints", action="store_true",
                        help="serve GET /debug/engine: the engine's queues, pages and slots, "
                             "its invariants checked")
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


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of the flags (ValueError naming a bad one)."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.skip_tokenizer_init:
        raise ValueError("serve needs a tokenizer: drop --skip-tokenizer-init")
    if args.watchdog_timeout < 0:
        raise ValueError(f"--watchdog-timeout must be >= 0, got {args.watchdog_timeout}")
    if args.update_weights_dir is not None and not Path(args.update_weights_dir).is_dir():
        raise ValueError(f"--update-weights-dir {args.update_weights_dir}: not a directory")
    api_key = resolve_api_key(args.api_key, args.api_key_file)
    try:
        return ServerConfig(
            args.served_model_name or str(args.model), api_key, args.max_queued_requests,
            args.max_request_body_bytes, args.max_request_sequences, args.max_request_tokens,
            tuple(args.allowed_origins) if args.allowed_origins else None,
            args.watchdog_timeout or None, args.enable_debug_endpoints,
            args.update_weights_dir)
    except ValueError as e:  # its messages start with the field: the flag's name
        name, rest = str(e).split(" ", 1)
        raise ValueError(f"--{name.replace('_', '-')} {rest}") from None


def hard_exit(status: int) -> None:
    """Exit now, whatever the engine's thread is stuck in (interpreter shutdown could wait on
    it)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run(args: argparse.Namespace, engine_config: Any) -> int:
    """Serve until SIGTERM / SIGINT; returns the exit status (1 if the engine failed to load)."""
    try:
        import uvicorn
        from minijax_serve.server.app import build_app
    except ImportError as e:
        raise ValueError(f"serve needs the [serve] extra (pip install 'minijax_serve[serve]'): "
                         f"{e}") from None
    config = server_config(args)
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

    failed: list[Any] = []  # the load error, or the watchdog's message

    def on_fatal(err: Any) -> None:
        failed.append(err)
        server.should_exit = True

    app = build_app(make_engine, config, on_fatal, on_fatal)

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
    if app.state.engine_loop.hung is not None:
        hard_exit(1)
    return 1 if failed else 0
