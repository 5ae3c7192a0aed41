"""A streamed answer's server-sent events, and noticing that a client has gone."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi import Request

from minijax_serve.server.deltas import EngineFault
from minijax_serve.server.engine_loop import EngineLoop
from minijax_serve.server.protocol import APIError, ParsedRequest
from minijax_serve.server.responses import Choices


def sse(chunk: Any) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


async def disconnected(request: Request) -> None:
    """Return once the client has gone (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def abort_when_gone(request: Request, loop: EngineLoop, rid: str,
                    choices: Choices) -> asyncio.Future:
    """A task that aborts the request as soon as its client disconnects (uvicorn tells the
    receive channel; a stream would only notice at its next write). Started when the request is
    submitted, for either answer, so a client gone before its stream's first event is seen too."""

    async def watch() -> None:
        await disconnected(request)
        if not choices.done:
            loop.abort(rid)

    return asyncio.ensure_future(watch())


def drain(first: Any, queue: asyncio.Queue) -> list[Any]:
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def events(loop: EngineLoop, rid: str, choices: Choices, queue: asyncio.Queue,
                 parsed: ParsedRequest, gone: asyncio.Future) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer, ``data: [DONE]`` last (after an engine
    fault's error event too, as vLLM's); ``gone`` is the request's :func:`abort_when_gone`."""
    try:
        while not choices.done:
            parts = []
            for item in drain(await queue.get(), queue):
                if isinstance(item, EngineFault):
                    err = APIError(500, item.message, type="server_error")
                    yield sse(err.body()) + "data: [DONE]\n\n"
                    return
                parts += [sse(c) for c in choices.chunks(item, parsed.include_usage,
                                                         parsed.continuous_usage)]
            yield "".join(parts)
        if parsed.include_usage:
            yield sse(choices.usage_chunk())
        yield "data: [DONE]\n\n"
    finally:
        gone.cancel()
        if not choices.done:
            loop.abort(rid)
