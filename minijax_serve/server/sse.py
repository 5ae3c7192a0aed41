"""A streamed answer's server-sent events, and noticing that a client has gone."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi import Request

from minijax_serve.server.engine_loop import EngineFault, EngineLoop
from minijax_serve.server.protocol import APIError
from minijax_serve.server.responses import Choices


def sse(chunk: Any) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


async def disconnected(request: Request) -> None:
    """Return once the client has gone (the body is read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def drain(first: Any, queue: asyncio.Queue) -> list[Any]:
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def events(request: Request, loop: EngineLoop, rid: str, choices: Choices,
                 queue: asyncio.Queue, include_usage: bool) -> AsyncIterator[str]:
    """The server-sent events of a streamed answer. A client that disconnects aborts the
    request at once (uvicorn tells the receive channel; the stream itself would only notice at
    its next write)."""

    async def abort_when_gone() -> None:
        await disconnected(request)
        if not choices.done:
            loop.abort(rid)

    gone = asyncio.ensure_future(abort_when_gone())
    try:
        while not choices.done:
            parts = []
            for item in drain(await queue.get(), queue):
                if isinstance(item, EngineFault):
                    err = APIError(500, item.message, type="server_error")
                    yield sse(err.body())
                    return
                parts += [sse(c) for c in choices.chunks(item, include_usage)]
            yield "".join(parts)
        if include_usage:
            yield sse(choices.usage_chunk())
        yield "data: [DONE]\n\n"
    finally:
        gone.cancel()
        if not choices.done:
            loop.abort(rid)
