"""The FastAPI application: OpenAI's completions, chat completions and models endpoints,
``/health``, ``/metrics``, SGLang's ``/flush_cache`` and vLLM's ``/tokenize`` and
``/detokenize`` (:mod:`minijax_serve.server.tokenize`), over one :class:`EngineLoop`.

Handlers parse and check a request (tokenizing with their own copy of the tokenizer), then hand
it to the engine loop and await its Deltas: a streamed answer writes a server-sent event per
Delta, a whole one waits for every choice to finish. A client that disconnects aborts its
request at once. Every error has OpenAI's error body; bad input is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minijax_serve.frontend.inputs import chat_prompt_ids, check_request, prompt_ids, prompt_list
from minijax_serve.server.engine_loop import EngineFault, EngineLoop
from minijax_serve.server.messages import chat_messages
from minijax_serve.server.metrics import ServerMetrics
from minijax_serve.server.protocol import (CHAT_FIELDS, APIError, ParsedRequest, api_message, bad,
                                           check_fields, parse_chat, parse_completion)
from minijax_serve.server.responses import Choices, TokenText
from minijax_serve.server.sse import abort_when_gone, drain, events
from minijax_serve.server.tokenize import detokenize, tokenize
from minijax_serve.server.weights import add_update_weights

log = logging.getLogger("minijax_serve.server")
SHUTTING_DOWN = "the server is shutting down: the request was not run to its end"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """How the server answers (the engine's own configuration is the EngineConfig)."""

    served_model_name: str
    api_key: str | None = None  # every endpoint but /health then needs "Bearer <key>"
    max_queued_requests: int | None = None  # requests submitted and not running yet; 503 past it
    update_weights_dir: str | None = None  # POST /update_weights_from_disk reads under it only


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


async def _json(request: Request) -> Any:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None


class APIKeyMiddleware:
    """Every HTTP endpoint but /health needs ``Authorization: Bearer <key>`` (a pure ASGI
    middleware: streamed responses pass through untouched)."""

    def __init__(self, app: Any, api_key: str):
        self.app, self._expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self._expected):
                err = APIError(401, "Incorrect API key provided: send 'Authorization: Bearer "
                                    "<key>'", code="invalid_api_key")
                return await _error(err)(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(make_engine: Callable[[], Any], config: ServerConfig,
              on_load_error: Callable[[BaseException], None] | None = None) -> FastAPI:
    """The server's application; the engine is built by ``make_engine`` on the engine loop's
    thread when the app starts (``/health`` answers 503 until then; ``on_load_error(err)``
    if it raises)."""
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = ServerMetrics(lambda: loop.snapshot)
        loop = EngineLoop(make_engine, asyncio.get_running_loop(), config.max_queued_requests,
                          observe=metrics.observe, on_load_error=on_load_error)
        state.update(loop=loop, metrics=metrics)
        app.state.engine_loop = loop
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="minijax_serve", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return _error(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _error(APIError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return _error(APIError(500, f"internal error: {type(err).__name__}: {err}",
                               type="server_error"))

    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)

    def engine_loop() -> EngineLoop:
        loop = state["loop"]
        if not loop.ready.is_set() or loop.load_error is not None:
            raise APIError(503, "the model is not loaded yet", type="service_unavailable_error")
        return loop

    def check_model(body: Any) -> None:
        """A 404 (OpenAI's) for a request naming another model; checked before its other fields."""
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model != config.served_model_name:
            raise APIError(404, f"The model '{model}' does not exist (this server serves "
                                f"'{config.served_model_name}')", "model", code="model_not_found")

    def max_model_len(engine: Any) -> int:
        """The longest prompt + output one request can have: the context, or the KV pool if
        smaller."""
        return min(engine.context_length, engine.limits.pool_tokens)

    def checked(ids: list[int], parsed: ParsedRequest, where: str) -> list[int]:
        try:
            check_request(ids, parsed.params, engine_loop().engine.limits, where)
        except ValueError as e:
            raise parsed.error(e, where.split("[")[0]) from None
        return ids

    async def check_grammar(loop: EngineLoop, parsed: ParsedRequest) -> None:
        """Compile the request's grammar, if any, on a worker thread (not the event loop's:
        a large one, or the tokenizer's first conversion, takes a while); the engine keeps it
        for the request's matcher."""
        if parsed.params.grammar is not None:
            try:
                await asyncio.to_thread(loop.engine.check_grammar, parsed.params)
            except ValueError as e:
                raise parsed.error(e) from None

    @app.get("/health")
    async def health() -> Response:
        loop = state["loop"]
        if loop.load_error is not None:
            return _error(APIError(503, f"the engine failed to load: {loop.load_error}",
                                   type="service_unavailable_error"))
        if not loop.ready.is_set():
            return _error(APIError(503, "the model is loading", type="service_unavailable_error"))
        return JSONResponse({"status": "ok"})

    def model_card() -> dict[str, Any]:
        return {"id": config.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "minijax_serve", "max_model_len": max_model_len(engine_loop().engine)}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        check_model({"model": model})
        return JSONResponse(model_card())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state["metrics"].text(), media_type="text/plain; version=0.0.4")

    @app.post("/flush_cache")
    async def flush_cache() -> JSONResponse:
        try:
            await asyncio.wrap_future(engine_loop().call(lambda engine: engine.flush_cache()))
        except RuntimeError as e:
            raise bad(f"cannot flush the cache now: {e}") from None
        return JSONResponse({"message": "the prefix cache was flushed"})

    if config.update_weights_dir is not None:
        add_update_weights(app, engine_loop, _json, config.update_weights_dir)

    @app.post("/tokenize")
    async def tokenize_text(request: Request) -> JSONResponse:
        body, loop = await _json(request), engine_loop()
        check_model(body)
        return JSONResponse(tokenize(body, loop.tokenizer, max_model_len(loop.engine)))

    @app.post("/detokenize")
    async def detokenize_ids(request: Request) -> JSONResponse:
        body, loop = await _json(request), engine_loop()
        check_model(body)
        return JSONResponse(detokenize(body, loop.tokenizer, loop.engine.model_config.vocab_size))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _json(request)
        check_model(body)
        parsed, prompt = parse_completion(body)
        loop = engine_loop()
        try:
            prompts, names = prompt_list(prompt)
            names = [n.replace("prompts", "prompt") for n in names]
            if not prompts:
                raise ValueError("prompt must not be an empty list")
            vocab = loop.engine.model_config.vocab_size
            ids = [prompt_ids(p, w, loop.tokenizer, vocab) for p, w in zip(prompts, names)]
        except ValueError as e:
            raise bad(api_message(str(e)).replace("prompts", "prompt"), "prompt") from None
        ids = [checked(i, parsed, w) for i, w in zip(ids, names)]
        await check_grammar(loop, parsed)
        echo = None
        if parsed.echo:  # a prompt's own text, or its ids decoded; one entry per choice
            decode = loop.tokenizer.decode if loop.tokenizer else lambda ids: ""
            echo = [(p if isinstance(p, str) else decode(i), i) for p, i in zip(prompts, ids)
                    for _ in range(parsed.params.n)]
        return await _answer(request, loop, parsed, ids, chat=False, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _json(request)
        check_model(body)
        body = check_fields(body, CHAT_FIELDS)
        messages = chat_messages(body.get("messages"))
        loop = engine_loop()
        try:
            ids = chat_prompt_ids(loop.tokenizer, messages)
        except Exception as e:  # a template may raise anything on a conversation it refuses
            raise bad(f"messages: {e}", "messages") from None
        limit = max_model_len(loop.engine)
        asked = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
        if len(ids) >= limit and not asked:
            raise APIError(400, f"messages ({len(ids)} tokens) leave no room for an answer in the "
                                f"{limit} tokens of the context (or the KV pool)", "messages",
                           code="context_length_exceeded")
        parsed = parse_chat(body, max(1, limit - len(ids)))
        ids = checked(ids, parsed, "messages")
        await check_grammar(loop, parsed)
        return await _answer(request, loop, parsed, [ids], chat=True)

    async def _answer(request: Request, loop: EngineLoop, parsed: ParsedRequest,
                      prompts: list[list[int]], chat: bool,
                      echo: list[tuple[str, list[int]]] | None = None) -> Response:
        choices = Choices(chat, config.served_model_name, list(map(len, prompts)),
                          parsed.params.n, parsed.logprobs,
                          TokenText(loop.tokenizer, parsed.tokens_as_ids), echo, parsed.echo_only)
        queue: asyncio.Queue = asyncio.Queue()
        rid = choices.id
        if not loop.submit(rid, prompts, parsed.params, queue, stream=parsed.stream):
            if loop.stopping:
                raise APIError(503, SHUTTING_DOWN, type="service_unavailable_error")
            raise APIError(503, "the server is busy: its queue of waiting requests is full "
                                "(--max-queued-requests); retry later",
                           type="service_unavailable_error", code="queue_full")
        gone = abort_when_gone(request, loop, rid, choices)
        if parsed.stream:
            return StreamingResponse(events(loop, rid, choices, queue, parsed, gone),
                                     media_type="text/event-stream")
        try:
            while not choices.done:
                get = asyncio.ensure_future(queue.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return Response(status_code=499)  # aborted; nobody reads it
                for item in drain(get.result(), queue):
                    if isinstance(item, EngineFault):
                        raise APIError(500, item.message, type="server_error")
                    choices.add(item)
        finally:
            gone.cancel()
            if not choices.done:
                loop.abort(rid)
        if "abort" in choices.finish:  # only a shutdown aborts a request whose client waits
            raise APIError(503, SHUTTING_DOWN, type="service_unavailable_error")
        return JSONResponse(choices.body())

    return app
