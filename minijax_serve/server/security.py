"""Who may call the server: the API key (from the flag, a file or ``MINIJAX_SERVE_API_KEY``,
never logged: :func:`~minijax_serve.server.server_config.resolve_api_key`) and the browser
origins allowed.

A browser sends any page's POST to a local server, and a "simple" request (``text/plain``, no
body) runs without a CORS preflight: JSON endpoints therefore refuse other content types (415,
:mod:`minijax_serve.server.intake`) and :class:`OriginGuard` answers 403 to a request whose
``Origin`` is neither the server's own nor allowed (``--allowed-origins``, which also turns
CORS on, as vLLM's flag does). Clients that are not browsers send no ``Origin``.
"""

from __future__ import annotations

import secrets
from typing import Any, Callable

from fastapi.responses import JSONResponse

from minijax_serve.server.protocol import APIError

def _refuse(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


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
                return await _refuse(err)(scope, receive, send)
        await self.app(scope, receive, send)


class OriginGuard:
    """A 403 for a request from a browser page of another origin than the server's own that is
    not in ``allowed`` ("*": any); requests without ``Origin`` pass."""

    def __init__(self, app: Any, allowed: tuple[str, ...] = ()):
        self.app, self._allowed = app, {o.rstrip("/").lower() for o in allowed}

    def allows(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/").lower()
        own = {f"http://{host}", f"https://{host}"}
        return "*" in self._allowed or origin in self._allowed or origin in own

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            origin = headers.get(b"origin")
            host = headers.get(b"host", b"").decode("latin-1").lower()
            if origin is not None and not self.allows(origin.decode("latin-1"), host):
                err = APIError(403, "cross-origin requests are refused: this origin is not in "
                                    "the server's --allowed-origins", code="origin_not_allowed")
                return await _refuse(err)(scope, receive, send)
        await self.app(scope, receive, send)
