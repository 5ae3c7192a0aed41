"""The FastAPI application: OpenAI's completions, chat completions and models endpoints,
``/health``, ``/metrics``, SGLang's ``/flush_cache`` and vLLM's ``/tokenize`` and
``/detokenize`` (:mod:`minijax_serve.server.tokenize`), over one :class:`EngineLoop`.

A handler reads its JSON body within the server's bounds (:mod:`~minijax_serve.server.intake`),
prepares the request on an intake worker thread (:mod:`~minijax_serve.server.prepare`: parsed,
tokenized, checked), then hands it to the engine loop and answers it
(:mod:`~minijax_serve.server.answer`). The event loop itself does no work that grows with a
request, so ``/health`` and every other answer come at once. Every error has OpenAI's error body
(:mod:`~minijax_serve.server.errors`); bad input is a 4xx naming the field. The OpenAPI schema
describes every body (:mod:`~minijax_serve.server.schema`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from minijax_serve.server.answer import answer, unavailable
from minijax_serve.server.debug import engine_report
from minijax_serve.server.engine_loop import EngineLoop
from minijax_serve.server.errors import InternalErrors, error_response, install_error_handlers
from minijax_serve.server.intake import Intake, parse_json, read_body
from minijax_serve.server.metrics import ServerMetrics
from minijax_serve.server.openapi import install_openapi
from minijax_serve.server.prepare import Preparer, max_model_len
from minijax_serve.server.protocol import APIError, bad
from minijax_serve.server.schema import (BODY_ERRORS, ERRORS, EVENT_STREAM,
                                         ChatCompletionResponse, CompletionResponse,
                                         DetokenizeResponse, Health, Message, ModelCard,
                                         ModelList, TokenizeResponse)
from minijax_serve.server.security import APIKeyMiddleware, OriginGuard
from minijax_serve.server.server_config import ServerConfig
from minijax_serve.server.watchdog import Watchdog
from minijax_serve.server.weights import add_update_weights

__all__ = ["ServerConfig", "build_app"]


def _ok(model: type, errors: dict = ERRORS, **content: Any) -> dict:
    return {200: {"model": model, **({"content": content} if content else {})}, **errors}


def build_app(make_engine: Callable[[], Any], config: ServerConfig,
              on_load_error: Callable[[BaseException], None] | None = None,
              on_hang: Callable[[str], None] | None = None) -> FastAPI:
    """The server's application; the engine is built by ``make_engine`` on the engine loop's
    thread when the app starts (``/health`` answers 503 until then; ``on_load_error(err)``
    if it raises). With ``config.watchdog_timeout``, ``on_hang(message)`` is called when a
    step outlasts it."""
    state: dict[str, Any] = {}
    intake = Intake(lambda: state["loop"].tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = ServerMetrics(lambda: loop.snapshot)
        loop = EngineLoop(make_engine, asyncio.get_running_loop(), config.max_queued_requests,
                          observer=metrics, on_load_error=on_load_error)
        state.update(loop=loop, metrics=metrics)
        app.state.engine_loop = loop
        loop.start()
        watchdog = None
        if config.watchdog_timeout is not None:
            watchdog = Watchdog(loop, config.watchdog_timeout, on_hang)
            watchdog.start()
        try:
            yield
        finally:
            if watchdog is not None:
                watchdog.stop()
            intake.shutdown()
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="minijax_serve", lifespan=lifespan)
    install_error_handlers(app)
    install_openapi(app, lambda: bounds(state.get("loop")))
    # middlewares, innermost first: the key, the origin, CORS, then the catch-all
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(OriginGuard, allowed=config.allowed_origins or ())
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(InternalErrors)

    def engine_loop() -> EngineLoop:
        loop = state["loop"]
        if not loop.ready.is_set() or loop.load_error is not None:
            raise APIError(503, "the model is not loaded yet", type="service_unavailable_error")
        if loop.hung is not None:
            raise unavailable(loop)
        return loop

    preparer = Preparer(config, engine_loop, intake)

    def bounds(loop: EngineLoop | None) -> dict[str, Any] | None:
        """The bounds of the OpenAPI schema (None until the model is loaded)."""
        if loop is None or not loop.ready.is_set() or loop.load_error is not None:
            return None
        engine = loop.engine
        return {"model": config.served_model_name, "max_model_len": max_model_len(engine),
                "max_token_id": engine.model_config.vocab_size - 1,
                "max_n": min(engine.config.max_running_requests, config.max_request_sequences),
                "max_logprobs": engine.config.max_logprobs}

    @app.get("/health", responses=_ok(Health, {503: ERRORS[503]}))
    async def health() -> Response:
        loop = state["loop"]
        if loop.hung is not None:
            return error_response(unavailable(loop))
        if loop.load_error is not None:
            return error_response(APIError(503, f"the engine failed to load: {loop.load_error}",
                                           type="service_unavailable_error"))
        if not loop.ready.is_set():
            return error_response(APIError(503, "the model is loading",
                                           type="service_unavailable_error"))
        return JSONResponse({"status": "ok"})

    def model_card() -> dict[str, Any]:
        return {"id": config.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "minijax_serve", "max_model_len": max_model_len(engine_loop().engine)}

    @app.get("/v1/models", responses=_ok(ModelList))
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}", responses=_ok(ModelCard, {**ERRORS, 404: BODY_ERRORS[404]}))
    async def model(model: str) -> JSONResponse:
        preparer.check_model({"model": model})
        return JSONResponse(model_card())

    @app.get("/metrics", response_class=PlainTextResponse, responses=ERRORS)
    async def metrics() -> Response:
        return Response(state["metrics"].text(), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache", responses=_ok(Message, {**ERRORS, 400: BODY_ERRORS[400]}))
    async def flush_cache() -> JSONResponse:
        loop = engine_loop()
        try:
            await asyncio.wrap_future(loop.call(lambda engine: engine.flush_cache()))
        except RuntimeError as e:
            if loop.hung is not None:
                raise unavailable(loop) from None
            raise bad(f"cannot flush the cache now: {e}") from None
        return JSONResponse({"message": "the prefix cache was flushed"})

    if config.enable_debug_endpoints:
        @app.get("/debug/engine", responses=ERRORS)
        async def debug_engine() -> JSONResponse:
            report = await asyncio.wrap_future(engine_loop().call(engine_report))
            return JSONResponse(report)

    async def body(request: Request) -> bytes:
        return await read_body(request, config.max_request_body_bytes)

    if config.update_weights_dir is not None:
        async def json_body(request: Request) -> Any:
            return await intake.run(parse_json, await body(request))

        add_update_weights(app, engine_loop, json_body, config.update_weights_dir)

    @app.post("/tokenize", responses=_ok(TokenizeResponse, BODY_ERRORS))
    async def tokenize_text(request: Request) -> JSONResponse:
        return JSONResponse(await intake.run(preparer.tokenize, await body(request)))

    @app.post("/detokenize", responses=_ok(DetokenizeResponse, BODY_ERRORS))
    async def detokenize_ids(request: Request) -> JSONResponse:
        return JSONResponse(await intake.run(preparer.detokenize, await body(request)))

    @app.post("/v1/completions", responses=_ok(CompletionResponse, BODY_ERRORS, **EVENT_STREAM))
    async def completions(request: Request) -> Response:
        prep = await intake.run(preparer.completion, await body(request))
        return await answer(request, state["loop"], prep, False, config.served_model_name)

    @app.post("/v1/chat/completions",
              responses=_ok(ChatCompletionResponse, BODY_ERRORS, **EVENT_STREAM))
    async def chat_completions(request: Request) -> Response:
        prep = await intake.run(preparer.chat, await body(request))
        return await answer(request, state["loop"], prep, True, config.served_model_name)

    return app
