"""The timed part of ``bench --backend openai``: a streaming HTTP client of an OpenAI-compatible
server, with the in-process driver's traffic rules (:mod:`minijax_serve.bench.driver`).

Requests are sent in arrival order at ``start + offsets[i]``, at most ``max_concurrency``
unfinished at a time, each on its own asyncio task over one ``httpx.AsyncClient``. A request's
latencies count from when the client sends it: its scheduled arrival time, or, when
``max_concurrency`` held it back, the finish time of the request that freed its place (places
free in finish order, so the earliest-freed place is taken first, as the driver's heap does).
Neither depends on when the event loop got round to sending it.

Each response is read line by line as it streams; the time of every chunk that carried output
is recorded (the first is the TTFT, the gaps are the ITLs) and the token counts are the server's
final ``usage``, not the number of chunks. A status other than 200, an error event, a broken
connection, a stream that ends before ``data: [DONE]`` or without usage fails that request (its
error is kept) and the run goes on.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Awaitable, Callable, NamedTuple, Sequence

import httpx

from minijax_serve.bench.openai_api import DONE, ENDPOINTS, body_message, parse_chunk, sse_data

CONNECT_TIMEOUT_S = 30.0  # no read timeout: a long output under load streams for minutes


class StreamResult(NamedTuple):
    """One streamed request as the client saw it (times from the client's clock)."""

    token_times: list[float]  # of each chunk that carried output
    finish_time: float  # when the stream ended, or broke
    prompt_tokens: int  # the server's usage (0 on failure)
    output_tokens: int
    error: str | None  # why it failed; None if it completed

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None


class HttpRun(NamedTuple):
    start: float  # clock when the first request could be sent
    duration: float  # seconds from ``start`` until the last request ended
    sent: list[float]  # per request: when it was sent
    outputs: list[StreamResult]

    @property
    def errors(self) -> list[str | None]:
        return [o.error for o in self.outputs]

    def finished(self) -> list[tuple[StreamResult, float]]:
        """(result, time sent) of every request that completed."""
        return [(o, s) for o, s in zip(self.outputs, self.sent) if o.error is None]


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def served_model_name(base_url: str, api_key: str | None = None,
                      transport: httpx.BaseTransport | None = None) -> str:
    """The first model id of ``GET {base_url}/v1/models``."""
    url = f"{base_url}/v1/models"
    hint = "is the server up? or pass --served-model-name"
    try:
        with httpx.Client(headers=auth_headers(api_key), transport=transport,
                          timeout=httpx.Timeout(CONNECT_TIMEOUT_S)) as client:
            response = client.get(url)
    except httpx.HTTPError as err:
        raise ValueError(f"--base-url: GET {url} failed ({type(err).__name__}: {err}); "
                         f"{hint}") from None
    if response.status_code != 200:
        raise ValueError(f"--base-url: GET {url} answered HTTP {response.status_code}: "
                         f"{body_message(response.text)}; {hint}")
    try:
        return str(response.json()["data"][0]["id"])
    except (ValueError, LookupError, TypeError):
        raise ValueError(f"--base-url: GET {url} listed no model ({response.text[:200]!r}); "
                         "pass --served-model-name") from None


async def stream_one(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                     clock: Callable[[], float] = time.perf_counter) -> StreamResult:
    """POST ``body`` to ``path`` and read its event stream to the end."""
    times: list[float] = []
    usage: dict[str, Any] | None = None
    error, done, end = None, False, None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", errors="replace")
                return StreamResult([], clock(), 0, 0,
                                    f"HTTP {response.status_code}: {body_message(text)}")
            async for line in response.aiter_lines():
                now = clock()
                data = sse_data(line)
                if data is None or done:  # read to the end: the connection goes back to the pool
                    continue
                if data.strip() == DONE:
                    done, end = True, now
                    continue
                chunk = parse_chunk(data)
                if chunk.error is not None:
                    error = chunk.error
                    break
                if chunk.has_output:
                    times.append(now)
                if chunk.usage is not None:
                    usage = chunk.usage
    except httpx.HTTPError as err:  # connect, read, protocol: the stream broke (before [DONE])
        if not done:
            error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    end = clock() if end is None else end  # the request ends at data: [DONE]
    if error is None and not done:
        error = "the stream ended before data: [DONE]"
    usage = usage or {}
    n_in, n_out = usage.get("prompt_tokens", 0), usage.get("completion_tokens")
    if error is None and not (isinstance(n_in, int) and isinstance(n_out, int)):
        error = ("no usage.completion_tokens in the stream (does the server honour "
                 "stream_options.include_usage?)")
    if error is not None:
        return StreamResult(times, end, 0, 0, error)
    return StreamResult(times, end, n_in, n_out, None)


async def send_all(client: httpx.AsyncClient, path: str, bodies: Sequence[dict[str, Any]],
                   offsets: Sequence[float], max_concurrency: int | None = None,
                   on_finish: Callable[[int], Any] | None = None,
                   clock: Callable[[], float] = time.perf_counter,
                   sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep) -> HttpRun:
    """Send ``bodies[i]`` at ``start + offsets[i]`` (module docstring) and wait for every
    response; ``on_finish(1)`` as each request ends (a progress bar)."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    n = len(bodies)
    sent = [0.0] * n
    outputs: list[StreamResult | None] = [None] * n
    places: asyncio.Queue[float] | None = None  # when each free place freed, in that order
    if max_concurrency is not None:
        places = asyncio.Queue()
        for _ in range(max_concurrency):
            places.put_nowait(-math.inf)

    async def one(i: int) -> None:
        outputs[i] = out = await stream_one(client, path, bodies[i], clock)
        if places is not None:
            places.put_nowait(out.finish_time)
        if on_finish is not None:
            on_finish(1)

    start = clock()
    tasks = []
    for i in sorted(range(n), key=lambda i: offsets[i]):
        when = start + offsets[i]
        if when > clock():
            await sleep(when - clock())
        if places is not None:
            when = max(when, await places.get())
        sent[i] = when
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    end = max((o.finish_time for o in outputs), default=start)
    return HttpRun(start, end - start, sent, outputs)


def run_http(base_url: str, endpoint: str, bodies: Sequence[dict[str, Any]],
             offsets: Sequence[float], max_concurrency: int | None = None,
             api_key: str | None = None, on_finish: Callable[[int], Any] | None = None,
             transport: httpx.AsyncBaseTransport | None = None) -> HttpRun:
    """:func:`send_all` to ``base_url``'s ``endpoint`` (completions or chat), on a client with
    a connection per place (``max_concurrency``; unlimited without it) and a connect timeout
    only."""
    async def main() -> HttpRun:
        limits = httpx.Limits(max_connections=max_concurrency,
                              max_keepalive_connections=max_concurrency)
        async with httpx.AsyncClient(base_url=base_url, headers=auth_headers(api_key),
                                     timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                                     limits=limits, transport=transport) as client:
            return await send_all(client, ENDPOINTS[endpoint], bodies, offsets, max_concurrency,
                                  on_finish)

    return asyncio.run(main())
