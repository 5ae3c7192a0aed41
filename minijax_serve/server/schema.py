"""The OpenAPI description of the server: every request body and response as a pydantic model.

The handlers check a body field by field themselves (:mod:`minijax_serve.server.protocol`:
OpenAI's error body naming the field, the engine's limits); these models describe the same
fields for ``/openapi.json`` (tests keep both in step), so clients and fuzzers such as
schemathesis can work from the server's own schema. :func:`install_openapi` puts each request
body into the operation it belongs to.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field

from minijax_serve.sampling_params import MAX_LOGPROBS


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

    model: str | None = Field(None, description="the served model name (404 for another)")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0)
    user: str | None = None
    return_tokens_as_token_ids: bool | None = None
    response_format: ResponseFormat | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, description="-1: off")
    min_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, description="samples per prompt")
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100]")
    regex: str | None = None
    ebnf: str | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a text, a list of token ids, or a list of either (one choice set each)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TokenizeRequest(_Request):
    """``POST /tokenize``: exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Request):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


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


REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
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
EVENT_STREAM = {"text/event-stream": {"schema": {"type": "string"},
                                      "description": "with stream: true, server-sent events"}}


def install_openapi(app: FastAPI) -> None:
    """``app.openapi()`` with the request body of each endpoint in :data:`REQUEST_BODIES` (the
    handlers read their bodies themselves, so FastAPI does not know them)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in REQUEST_BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}",
                                               by_alias=True)
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/"
                                                            f"{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
