"""A prepared generation request queued on the engine loop and answered: streamed as
server-sent events (:mod:`minijax_serve.server.sse`) or whole once every choice finished. A
client that disconnects aborts its request at once."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minijax_serve.server.deltas import EngineFault
from minijax_serve.server.engine_loop import EngineLoop
from minijax_serve.server.prepare import Prepared
from minijax_serve.server.protocol import APIError
from minijax_serve.server.responses import Choices, TokenText
from minijax_serve.server.sse import abort_when_gone, drain, events

SHUTTING_DOWN = "the server is shutting down: the request was not run to its end"


def unavailable(loop: EngineLoop) -> APIError:
    """The 503 of a loop that takes no more requests."""
    if loop.hung is not None:
        return APIError(503, f"the server is unhealthy: {loop.hung}",
                        type="service_unavailable_error")
    if loop.stopping:
        return APIError(503, SHUTTING_DOWN, type="service_unavailable_error")
    return APIError(503, "the server is busy: its queue of waiting requests is full "
                         "(--max-queued-requests); retry later",
                    type="service_unavailable_error", code="queue_full")


async def answer(request: Request, loop: EngineLoop, prep: Prepared, chat: bool,
                 model: str) -> Response:
    """Queue ``prep`` and answer it (``model``: the served model's name)."""
    parsed, prompts = prep.parsed, prep.prompts
    choices = Choices(chat, model, list(map(len, prompts)), parsed.params.n, parsed.logprobs,
                      TokenText(loop.tokenizer, parsed.tokens_as_ids), prep.echo,
                      parsed.echo_only)
    queue: asyncio.Queue = asyncio.Queue()
    rid = choices.id
    if not loop.submit(rid, prompts, parsed.params, queue, stream=parsed.stream):
        raise unavailable(loop)
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
