"""A request body read within its bounds, and the CPU work of a request (JSON parsing,
chat templating, tokenization) off the event loop.

:func:`read_body` takes a JSON endpoint's body: ``Content-Type: application/json`` or a 415,
at most ``max_body_bytes`` or a 413 (from ``Content-Length`` before anything is read, else as
soon as the bytes read pass it). :func:`parse_json` parses it on a worker thread: nesting deeper
than :data:`MAX_JSON_DEPTH` and strings that are not Unicode (a lone surrogate escape such as
``"\\ud800"``, which no tokenizer takes) are 400s naming the field, and a number with no
fraction is an integer whatever its spelling (JSON's: ``3.0`` is ``3``). :class:`Intake` runs that
work, and each endpoint's checks and tokenization, on a few worker threads, each with its own
copy of the tokenizer, so that ``/health`` and every other response answer at once whatever a
client sends (the tokenizer releases the GIL while it encodes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import re
import threading
from typing import Any, Callable, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from minijax_serve.server.protocol import APIError, bad

MAX_JSON_DEPTH = 100  # nested objects and arrays; a RecursionError lies past ~1,000
INTAKE_WORKERS = 2
_SURROGATE = re.compile("[\ud800-\udfff]")
T = TypeVar("T")


def is_json(content_type: str | None) -> bool:
    """``application/json`` (parameters such as ``charset`` allowed)."""
    return (content_type or "").split(";")[0].strip().lower() == "application/json"


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body of a JSON endpoint's request (an APIError 415 or 413 if it is not one)."""
    if not is_json(request.headers.get("content-type")):
        raise APIError(415, "the request body must be JSON: send 'Content-Type: application/json'",
                       code="unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:  # nobody reads the answer: no internal error either
        raise bad("the client disconnected before it sent its whole body") from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body is larger than the server's limit of {max_bytes} "
                         "bytes (--max-request-body-bytes)", code="request_too_large")


def parse_json(raw: bytes) -> Any:
    """The JSON value of a request body, checked: nesting at most :data:`MAX_JSON_DEPTH`, every
    string valid Unicode (APIError 400 naming the top-level field otherwise)."""
    try:
        value = json.loads(raw, parse_float=_number)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    check_json(value)
    return value


def _number(text: str) -> int | float:
    """A JSON number written with a fraction or an exponent: an int when it is integral."""
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2**63 else value


def _too_deep() -> APIError:
    return bad(f"the request body nests objects and arrays deeper than {MAX_JSON_DEPTH} levels")


def check_json(value: Any) -> None:
    """Raise an APIError 400 if ``value`` nests deeper than :data:`MAX_JSON_DEPTH` or holds a
    string (or key) with a lone surrogate; walked without recursion."""
    stack: list[tuple[Any, int, str | None]] = [(value, 0, None)]
    while stack:
        item, depth, field = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                where = f"{field}: " if field else ""
                raise bad(f"{where}a string holds a lone surrogate ({found[0]!a}): not valid "
                          "Unicode", field)
            continue
        if depth >= MAX_JSON_DEPTH:
            raise _too_deep()
        if isinstance(item, dict):
            for key, v in item.items():
                found = _SURROGATE.search(key)
                if found:
                    raise bad(f"an object key holds a lone surrogate ({found[0]!a}): not valid "
                              "Unicode", field)
                name = key if field is None else field
                if isinstance(v, (str, dict, list)):
                    stack.append((v, depth + 1, name))
        elif isinstance(item, list):
            stack.extend((v, depth + 1, field) for v in item if isinstance(v, (str, dict, list)))


class Intake:
    """Worker threads for a request's CPU work before it is queued; ``tokenizer()`` is the
    calling worker's own copy of ``source()`` (made on its first use: a fast tokenizer must not
    be used by two threads at once)."""

    def __init__(self, source: Callable[[], Any], workers: int = INTAKE_WORKERS):
        self._source = source
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="intake")
        self._local = threading.local()
        self._lock = threading.Lock()

    def tokenizer(self) -> Any:
        """This worker thread's tokenizer (None when the engine has none)."""
        if not hasattr(self._local, "tokenizer"):
            with self._lock:  # copies of one source, one at a time
                self._local.tokenizer = copy.deepcopy(self._source())
        return self._local.tokenizer

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
