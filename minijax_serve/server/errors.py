"""Every error with OpenAI's body, and no failure that reaches another request.

An :class:`APIError` and Starlette's HTTP errors (404, a 405 with its ``Allow`` header) are
answered as they are. Any other exception is a bug: :class:`InternalErrors` logs it once and
answers a 500; every 5xx carries ``Connection: close``, so a client's next request on a
keep-alive connection goes to a fresh one instead of one the server may have given up.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minijax_serve.server.protocol import APIError

log = logging.getLogger("minijax_serve.server")


class ErrorJSON(JSONResponse):
    """JSON in ASCII: a message quoting a client's text is sent whatever that text holds."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``err`` as a response (``Connection: close`` for a 5xx)."""
    headers = dict(headers or {})
    if err.status >= 500:
        headers["Connection"] = "close"
    return ErrorJSON(err.body(), status_code=err.status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI's error body for APIErrors and Starlette's HTTP errors (add
    :class:`InternalErrors` as the outermost middleware for the rest)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(err.status_code, str(err.detail)), err.headers)


class InternalErrors:
    """A pure ASGI middleware between Starlette's outermost one and the app: an exception no
    handler took is logged once and answered with a 500 (``Connection: close``); if the response
    had started (a stream), it is cut short and the connection closes."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as err:
            log.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                res = error_response(APIError(500, f"internal error: {type(err).__name__}: {err}",
                                              type="server_error"))
                await res(scope, receive, send)
