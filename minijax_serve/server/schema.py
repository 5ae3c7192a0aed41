"""The OpenAPI description of the server: every request body and response as a pydantic model.

The handlers check a body field by field themselves (:mod:`minijax_serve.server.protocol`:
OpenAI's error body naming the field, the engine's limits); these models describe the same
fields for ``/openapi.json`` (tests keep both in step), so clients and fuzzers such as
schemathesis can work from the server's own schema.
:func:`~minijax_serve.server.openapi.install_openapi` puts each request body into the operation
it belongs to, with this server's bounds (:data:`BOUND` marks) once its model is loaded.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from minijax_serve.core.sampling_params import (LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                           MAX_SEED)

BOUND = "x-bound"  # a schema node's maximum is the server's bound of this name, once known
TokenId = Annotated[int, Field(ge=0, json_schema_extra={BOUND: "max_token_id"})]
LogitBias = Annotated[dict[str, float], WithJsonSchema({
    "type": "object", "maxProperties": MAX_LOGIT_BIAS, "additionalProperties": False,
    "description": "token id (decimal) -> bias",
    "patternProperties": {"^(0|[1-9][0-9]*)$": {
        "type": "number", "minimum": -LOGIT_BIAS_RANGE, "maximum": LOGIT_BIAS_RANGE}}})]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
ModelName = Annotated[str | None, Field(description="the served model name (404 for another)",
                                        json_schema_extra={BOUND: "model"})]


def _max_tokens(**kwargs: Any) -> Any:
    return Field(None, ge=1, json_schema_extra={BOUND: "max_model_len"}, **kwargs)


def _top(**kwargs: Any) -> Any:
    return Field(None, ge=0, le=MAX_LOGPROBS, json_schema_extra={BOUND: "max_logprobs"},
                 **kwargs)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class _Sampling(_Request):
    """The fields both generation endpoints share (OpenAI's, vLLM's and SGLang's extras)."""

    model: ModelName = None
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    max_tokens: int | None = _max_tokens(description="(completions: 0 with echo, the prompt "
                                                     "alone)")
    user: str | None = None
    return_tokens_as_token_ids: bool | None = None
    response_format: ResponseFormat | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Literal[-1] | Annotated[int, Field(ge=1)] | None = Field(None, description="-1: off")
    min_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, description="samples per prompt",
                          json_schema_extra={BOUND: "max_n"})
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=-2**63, lt=2**63, description=f"taken modulo {MAX_SEED + 1}")
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: LogitBias | None = None
    regex: str | None = Field(None, description="at most one of regex, ebnf, response_format")
    ebnf: str | None = None
    speculate: bool | None = Field(None, description="false: no speculative decoding for it")


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: Text | TokenIds | Annotated[list[Text], Field(min_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1)] = Field(
        description="a text, a list of token ids, or a list of either (one choice set each)")
    logprobs: int | None = _top()
    echo: bool | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """(An assistant message may also have null content, and the answer's fields left empty.)"""

    role: str
    content: str | list[TextPart]
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = _max_tokens()
    logprobs: bool | None = None
    top_logprobs: int | None = _top(description="only with logprobs: true")


class _Tokenize(_Request):
    model: ModelName = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None


class TokenizeText(_Tokenize):
    """``POST /tokenize`` of a text."""

    prompt: str


class TokenizeChat(_Tokenize):
    """``POST /tokenize`` of a conversation, through the chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool | None = None


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: ModelName = None
    tokens: list[TokenId]


# -- responses ----------------------------------------------------------------------------

class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]


class Message(BaseModel):
    message: str


REQUEST_BODIES: dict[str, tuple[str, Any]] = {  # path: (the schema's name, its type)
    "/v1/completions": ("CompletionRequest", CompletionRequest),
    "/v1/chat/completions": ("ChatCompletionRequest", ChatCompletionRequest),
    "/tokenize": ("TokenizeRequest", TokenizeText | TokenizeChat),
    "/detokenize": ("DetokenizeRequest", DetokenizeRequest)}
_ERROR = {"model": ErrorResponse}
ERRORS: dict[int | str, dict[str, Any]] = {  # what any endpoint may answer besides its 200
    401: {**_ERROR, "description": "a wrong or missing API key (--api-key)"},
    403: {**_ERROR, "description": "a browser origin not allowed (--allowed-origins)"},
    503: {**_ERROR, "description": "the model is loading, the server is stopping or unhealthy, "
                                   "or the queue is full (retry later)"}}
BODY_ERRORS: dict[int | str, dict[str, Any]] = {  # ... and an endpoint with a JSON body
    **ERRORS,
    400: {**_ERROR, "description": "a bad request: the field is named in error.param"},
    404: {**_ERROR, "description": "the request names a model this server does not serve"},
    413: {**_ERROR, "description": "the body is larger than --max-request-body-bytes"},
    415: {**_ERROR, "description": "the body is not application/json"}}
EVENT_STREAM = {"text/event-stream": {"schema": {  # one server-sent event (stream: true)
    "type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "description": "a chunk or an error as JSON; [DONE] last"}}}}}
