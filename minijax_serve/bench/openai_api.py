"""The OpenAI-compatible wire format of ``bench --backend openai``: the request bodies, and the
server-sent events of a streamed response.

Every server gets the workload SGLang's and vLLM's ``bench_serving`` send: greedy
(``temperature`` 0), ``max_tokens`` = the dataset's output length, ``ignore_eos`` (an extension
that vLLM, SGLang and ours accept), streamed with ``stream_options.include_usage`` so that the
last chunk carries the server's token counts. ``completions`` sends the prompt as its token ids
(no tokenization on either side, the exact prompt of the in-process run); ``chat`` sends it
decoded as one user message, which the server tokenizes again through its chat template (its
prompt tokens are then those of the server's ``usage``). The bench's request fields are sent
only when set (a server that does not know ``repetition_penalty`` still runs a plain workload).

A streamed response is ``data: {json}`` lines (blank lines between events, ``:`` comments),
ended by ``data: [DONE]``. A chunk carries output when a choice has ``text`` (completions),
``delta.content`` or ``delta.reasoning_content`` (chat), or ``token_ids``.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple, Sequence

from minijax_serve.core.sampling_params import SamplingParams

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
DONE = "[DONE]"
_PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")


def request_body(endpoint: str, model: str, prompt_ids: Sequence[int], output_len: int,
                 ignore_eos: bool, fields: dict[str, Any], tokenizer: Any = None
                 ) -> dict[str, Any]:
    """The JSON body of one request; ``fields`` are the bench's request fields (logprobs and
    the penalties, :data:`~minijax_serve.bench.compare.REQUEST_FIELDS`)."""
    body: dict[str, Any] = {"model": model, "max_tokens": output_len, "temperature": 0.0,
                            "ignore_eos": ignore_eos, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint == "completions":
        body["prompt"] = [int(t) for t in prompt_ids]
    elif endpoint == "chat":
        if tokenizer is None:
            raise ValueError("--endpoint chat sends each prompt as text, decoded by the model's "
                             "tokenizer, and none is loaded (--skip-tokenizer-init, or a dummy "
                             "--model); use --endpoint completions or give --model a tokenizer")
        body["messages"] = [{"role": "user", "content": tokenizer.decode(list(prompt_ids))}]
    else:
        raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    logprobs = fields.get("logprobs")
    if logprobs is not None:
        body.update({"logprobs": logprobs} if endpoint == "completions"
                    else {"logprobs": True, "top_logprobs": logprobs})
    neutral = SamplingParams()
    for name in _PENALTIES:
        if name in fields and fields[name] != getattr(neutral, name):
            body[name] = fields[name]
    return body


def sse_data(line: str) -> str | None:
    """The data of a server-sent-event ``data:`` line (one space after the colon dropped), or
    None for any other line: blank, a ``:`` comment, an ``event:``/``id:``/``retry:`` field.

    Each ``data:`` line is taken as one event: OpenAI-compatible servers send every chunk as
    one line of JSON."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):]
    return data[1:] if data.startswith(" ") else data


def error_message(obj: Any) -> str | None:
    """The message of an error object (OpenAI's ``{"error": {"message"}}``, or vLLM's and
    SGLang's ``{"object": "error", "message"}``), None if ``obj`` is no error."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message", err))
    if err:
        return str(err)
    if obj.get("object") == "error":
        return str(obj.get("message", obj))
    return None


def body_message(text: str, limit: int = 300) -> str:
    """What a failed response's body says: its error message, else its start."""
    try:
        message = error_message(json.loads(text))
    except ValueError:
        message = None
    return message if message is not None else text[:limit]


class Chunk(NamedTuple):
    has_output: bool  # a choice carried text or tokens
    usage: dict[str, Any] | None
    error: str | None  # the stream reported an error, or the chunk was not a JSON object


def _has_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content")
                or choice.get("token_ids"))


def parse_chunk(data: str) -> Chunk:
    """One event's data (not ``[DONE]``) as a :class:`Chunk`."""
    try:
        obj = json.loads(data)
    except ValueError:
        return Chunk(False, None, f"malformed stream chunk: {data[:200]!r}")
    if not isinstance(obj, dict):
        return Chunk(False, None, f"stream chunk is not a JSON object: {data[:200]!r}")
    message = error_message(obj)
    if message is not None:
        return Chunk(False, None, f"the server reported an error mid-stream: {message}")
    usage = obj.get("usage")
    return Chunk(any(_has_output(c) for c in obj.get("choices") or ()),
                 usage if isinstance(usage, dict) else None, None)
