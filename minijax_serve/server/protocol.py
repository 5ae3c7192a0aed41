"""The OpenAI request bodies this server takes, checked field by field into SamplingParams.

Every field is either known (and used), known and unsupported (a 400 naming it unless it has
its no-op value, as ``suffix: ""``), or unknown (a 400, as OpenAI answers "Unrecognized request
argument"): nothing is silently ignored. Every error is an :class:`APIError` naming the field.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from minijax_serve.core.sampling_params import MAX_LOGPROBS, SamplingParams


class APIError(Exception):
    """An error answered with OpenAI's error body ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# The request fields of both endpoints that map onto SamplingParams (OpenAI name -> ours).
SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "n": "n", "stop": "stop", "seed": "seed", "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos", "min_tokens": "min_new_tokens",
    "stop_token_ids": "stop_token_ids", "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "logit_bias": "logit_bias", "regex": "regex", "ebnf": "ebnf", "speculate": "speculate",
}
# return_tokens_as_token_ids (vLLM's): logprobs name tokens "token_id:<id>", not by their text
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "user",
                 "return_tokens_as_token_ids", "response_format", *SAMPLING_FIELDS}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
# Known OpenAI fields this engine does not implement (echo: on chat), each with the values that
# mean "off".
UNSUPPORTED = {
    "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1),
    "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None,),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "store": (None, False),
    "metadata": (None,), "service_tier": (None, "auto", "default"),
    "prompt_logprobs": (None,),
}
# OpenAI's default temperature is 1 (the engine's own default is greedy).
OPENAI_DEFAULTS = {"temperature": 1.0}
API_NAMES = {v: k for k, v in SAMPLING_FIELDS.items()} | {"max_new_tokens": "max_tokens",
                                                           "json_schema": "response_format"}


class ParsedRequest(NamedTuple):
    """One HTTP request, checked: what the handler needs to run and answer it."""

    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: int | None  # top logprobs per token, None when not asked
    tokens_as_ids: bool  # logprobs name tokens "token_id:<id>"
    echo: bool = False  # completions: the prompt (and its logprobs) comes before the output
    echo_only: bool = False  # echo with max_tokens 0: the answer is the prompt alone
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    renamed: tuple[tuple[str, str], ...] = ()  # (OpenAI's field name, the one this request used)

    def error(self, err: Exception, param: str | None = None) -> APIError:
        """The 400 of an engine ValueError about this request, in the request's field names."""
        return engine_error(str(err), dict(self.renamed), param)


def api_message(message: str) -> str:
    """An engine error message with OpenAI's field names (``max_new_tokens`` -> ``max_tokens``)."""
    return re.sub(r"\b(max_new_tokens|min_new_tokens|json_schema)\b", lambda m: API_NAMES[m[1]],
                  message)


def error_param(message: str) -> str | None:
    """The request field an engine error message starts with, if any."""
    m = re.match(r"([a-z_]+)\b", message)
    if m is None:
        return None
    name = API_NAMES.get(m[1], m[1])
    return name if name in COMPLETION_FIELDS | CHAT_FIELDS else None


def engine_error(message: str, renamed: dict[str, str] | None = None,
                 param: str | None = None) -> APIError:
    """The 400 of an engine ValueError: OpenAI's field names in the message (or the request's
    own, ``renamed``: ``max_tokens`` -> ``max_completion_tokens``), the field it starts with as
    ``param`` (else ``param``), and OpenAI's ``context_length_exceeded`` code for a request too
    long for the context or the KV pool."""
    message = api_message(message)
    param = error_param(message) or param
    for api, used in (renamed or {}).items():
        message = re.sub(rf"\b{api}\b", used, message)
    too_long = re.search(r"exceeds (the context length|the KV pool)", message) is not None
    return APIError(400, message, (renamed or {}).get(param, param),
                    code="context_length_exceeded" if too_long else None)


def check_fields(body: Any, allowed: set[str]) -> dict[str, Any]:
    """``body`` as a JSON object whose every field is known and supported."""
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    for name, value in body.items():
        if name in allowed:
            continue
        if name in UNSUPPORTED:
            if not any(value == off and type(value) is type(off) for off in UNSUPPORTED[name]):
                where = "endpoint" if name in COMPLETION_FIELDS | CHAT_FIELDS else "server"
                raise bad(f"{name} is not supported by this {where}", name)
        else:
            raise bad(f"Unrecognized request argument supplied: {name}", name)
    return body


def _typed(body: dict[str, Any], name: str, types: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, types) or (
            isinstance(value, bool) and bool not in types)):
        raise bad(f"{name} must be {what}, got {value!r}", name)
    return value


def _int(body: dict[str, Any], name: str) -> int | None:
    return _typed(body, name, (int,), "an integer")


def logit_bias(value: Any) -> dict[int, Any]:
    """OpenAI's ``logit_bias`` object (token ids as strings) -> ``{token_id: bias}``."""
    if not isinstance(value, dict):
        raise bad(f"logit_bias must be an object mapping token ids to biases, got {value!r}",
                  "logit_bias")
    for key in value:
        if not re.fullmatch(r"0|[1-9][0-9]*", key):
            raise bad(f"logit_bias: keys must be token ids (decimal integers), got {key!r}",
                      "logit_bias")
    return {int(key): bias for key, bias in value.items()}


def seed(value: Any) -> Any:
    """OpenAI's ``seed`` (any 64-bit integer, as vLLM takes) -> the engine's, in [0, 2**32):
    the value modulo 2**32 (-1 is 2**32 - 1). Anything else is left for SamplingParams to
    refuse."""
    if isinstance(value, int) and not isinstance(value, bool):
        if not -2**63 <= value < 2**63:
            raise bad(f"seed must be a 64-bit integer, got {value}", "seed")
        return value % 2**32
    return value


def response_format(value: Any) -> Any:
    """OpenAI's ``response_format`` -> the JSON schema the output must fit (None for text)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = value.get("json_schema") if kind == "json_schema" else None
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise bad('response_format must be {"type": "text"}, {"type": "json_object"} or '
                  '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, got '
                  f"{value!r}", "response_format")
    return spec.get("schema", {})  # OpenAI's: no schema means any JSON value


def parse_common(body: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                 default_max_tokens: int, echo: bool = False,
                 renamed: tuple[tuple[str, str], ...] = ()) -> ParsedRequest:
    """The fields both endpoints share, into SamplingParams (ValueError messages with OpenAI's
    names, or the request's ``renamed`` ones, become 400s naming the field)."""
    model = _typed(body, "model", (str,), "a string")
    _typed(body, "user", (str,), "a string")
    stream = _typed(body, "stream", (bool,), "true or false") or False
    options = _typed(body, "stream_options", (dict,), "an object") or {}
    if options and not stream:
        raise bad("stream_options is only allowed with stream: true", "stream_options")
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise bad(f"stream_options: unknown option {sorted(unknown)[0]}", "stream_options")
    include_usage, continuous = (options.get(name, False)
                                 for name in ("include_usage", "continuous_usage_stats"))
    for name, value in (("include_usage", include_usage), ("continuous_usage_stats", continuous)):
        if not isinstance(value, bool):
            raise bad(f"stream_options.{name} must be true or false", "stream_options")
    fields: dict[str, Any] = dict(OPENAI_DEFAULTS)
    for api, ours in SAMPLING_FIELDS.items():
        value = body.get(api)
        if value is not None:
            fields[ours] = value
    if isinstance(fields.get("stop"), list) and not fields["stop"]:
        del fields["stop"]
    if "logit_bias" in fields:
        fields["logit_bias"] = logit_bias(fields["logit_bias"])
    if body.get("response_format") is not None:
        schema = response_format(body["response_format"])
        if schema is not None:
            fields["json_schema"] = schema
    if "seed" in fields:
        fields["seed"] = seed(fields["seed"])
    fields["max_new_tokens"] = default_max_tokens if max_tokens is None else max_tokens
    fields["logprobs"] = logprobs
    if echo:
        fields["prompt_logprobs"] = logprobs
    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError) as err:
        raise engine_error(str(err), dict(renamed)) from None
    as_ids = _typed(body, "return_tokens_as_token_ids", (bool,), "true or false") or False
    return ParsedRequest(model, params, stream, include_usage, logprobs, as_ids, echo=echo,
                         continuous_usage=include_usage and continuous, renamed=renamed)


def parse_completion(body: Any, default_max_tokens: int = 16) -> tuple[ParsedRequest, Any]:
    """(the request, its ``prompt``) of ``POST /v1/completions`` (OpenAI's default max_tokens
    is 16). ``echo``: the answer starts with the prompt, and with ``logprobs`` the prompt's
    tokens are scored too (the first has none), as vLLM does; with ``max_tokens`` 0 the answer
    is the prompt alone (vLLM's way to score a text: it generates one token and drops it)."""
    body = check_fields(body, COMPLETION_FIELDS)
    if body.get("prompt") is None:
        raise bad("prompt is required", "prompt")
    logprobs = _int(body, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
    echo = _typed(body, "echo", (bool,), "true or false") or False
    max_tokens = _int(body, "max_tokens")
    echo_only = echo and max_tokens == 0
    parsed = parse_common(body, 1 if echo_only else max_tokens, logprobs, default_max_tokens, echo)
    return parsed._replace(echo_only=echo_only), body["prompt"]


def parse_chat(body: dict[str, Any], default_max_tokens: int) -> ParsedRequest:
    """The request of ``POST /v1/chat/completions`` (a body :func:`check_fields` passed);
    without max_tokens it may run to ``default_max_tokens`` (what the context leaves)."""
    renamed = (("logprobs", "top_logprobs"),)  # chat's logprobs is true or false
    max_tokens, legacy = _int(body, "max_completion_tokens"), _int(body, "max_tokens")
    if max_tokens is None:
        max_tokens = legacy
    else:
        renamed += (("max_tokens", "max_completion_tokens"),)
    want = _typed(body, "logprobs", (bool,), "true or false") or False
    top = _int(body, "top_logprobs")
    if top is not None and not want:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}", "top_logprobs")
    return parse_common(body, max_tokens, (top or 0) if want else None, default_max_tokens,
                        renamed=renamed)
