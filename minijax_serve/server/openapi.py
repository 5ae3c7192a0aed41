"""``/openapi.json``: FastAPI's document of the routes, with the request body of each endpoint
(:data:`~minijax_serve.server.schema.REQUEST_BODIES`: the handlers read their bodies themselves,
so FastAPI does not know them) and, once the model is loaded, this server's bounds: the model's
name, token ids within the vocabulary, ``max_tokens`` within the context, ``n`` and the top
logprobs within the engine's limits."""

from __future__ import annotations

from typing import Any, Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import TypeAdapter

from minijax_serve.server.schema import BOUND, REQUEST_BODIES


def install_openapi(app: FastAPI, bounds: Callable[[], dict[str, Any] | None]) -> None:
    """``app.openapi()`` with the request body of each endpoint in :data:`REQUEST_BODIES` (the
    handlers read their bodies themselves, so FastAPI does not know them). ``bounds()``: the
    server's bounds by name (:data:`BOUND`), None until the model is loaded (the schema is
    kept once they are in)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description=app.description)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, (name, kind) in REQUEST_BODIES.items():
            body = TypeAdapter(kind).json_schema(ref_template="#/components/schemas/{model}",
                                                 by_alias=True)
            components.update(body.pop("$defs", {}))
            components[name] = body
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}
        known = bounds()
        _bound(components, known or {})
        if known is not None:
            app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _bound(node: Any, bounds: dict[str, Any]) -> None:
    """Replace each :data:`BOUND` mark under ``node`` with the bound it names (dropped when
    unknown): ``model`` the one name served, the others a maximum."""
    if isinstance(node, list):
        for item in node:
            _bound(item, bounds)
    elif isinstance(node, dict):
        name = node.pop(BOUND, None)
        if name == "model" and name in bounds:
            node.pop("anyOf", None)
            node["enum"] = [bounds["model"], None]
        elif name in bounds:
            node["maximum"] = min(bounds[name], node.get("maximum", bounds[name]))
        for value in node.values():
            _bound(value, bounds)
