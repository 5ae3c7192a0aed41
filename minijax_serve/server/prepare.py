"""Each endpoint's work before its request is queued, run on an intake worker thread
(:class:`~minijax_serve.server.intake.Intake`): the body parsed and checked field by field,
the prompts tokenized or the conversation templated, every bound of the engine and the server
checked, a grammar compiled. Every problem is an :class:`APIError` naming the field."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from minijax_serve.frontend.inputs import chat_prompt_ids, check_request, prompt_ids, prompt_list
from minijax_serve.server.engine_loop import EngineLoop
from minijax_serve.server.intake import Intake, parse_json
from minijax_serve.server.limits import check_sequences, check_tokens
from minijax_serve.server.messages import chat_messages
from minijax_serve.server.protocol import (CHAT_FIELDS, APIError, ParsedRequest, api_message, bad,
                                           check_fields, parse_chat, parse_completion)
from minijax_serve.server.server_config import ServerConfig
from minijax_serve.server.tokenize import detokenize, tokenize


class Prepared(NamedTuple):
    """A generation request ready to queue."""

    parsed: ParsedRequest
    prompts: list[list[int]]
    echo: list[tuple[str, list[int]]] | None = None  # completions' echo: one per choice


def max_model_len(engine: Any) -> int:
    """The longest prompt + output one request can have: the context, or the KV pool if
    smaller."""
    return min(engine.context_length, engine.limits.pool_tokens)


class Preparer:
    """The endpoints' preparation over the server's engine loop (``engine_loop()``: a 503
    until the model is loaded) and the intake worker's tokenizer."""

    def __init__(self, config: ServerConfig, engine_loop: Callable[[], EngineLoop],
                 intake: Intake):
        self.config, self._engine_loop, self._intake = config, engine_loop, intake

    def check_model(self, body: Any) -> None:
        """A 404 (OpenAI's) for a request naming another model; checked before its other
        fields."""
        model = body.get("model") if isinstance(body, dict) else None
        name = self.config.served_model_name
        if isinstance(model, str) and model != name:
            raise APIError(404, f"The model '{model}' does not exist (this server serves "
                                f"'{name}')", "model", code="model_not_found")

    def _body(self, raw: bytes) -> tuple[Any, EngineLoop]:
        body = parse_json(raw)
        self.check_model(body)
        return body, self._engine_loop()

    def completion(self, raw: bytes) -> Prepared:
        """``POST /v1/completions``."""
        body, loop = self._body(raw)
        parsed, prompt = parse_completion(body)
        try:
            prompts, names = prompt_list(prompt)
            if not prompts:
                raise ValueError("prompt must not be an empty list")
        except ValueError as e:
            raise bad(api_message(str(e)).replace("prompts", "prompt"), "prompt") from None
        names = [n.replace("prompts", "prompt") for n in names]
        check_sequences(self.config, len(prompts), parsed.params.n, loop.max_queued_requests)
        tokenizer = self._intake.tokenizer()
        try:
            vocab = loop.engine.model_config.vocab_size
            ids = [prompt_ids(p, w, tokenizer, vocab) for p, w in zip(prompts, names)]
        except ValueError as e:
            raise bad(api_message(str(e)).replace("prompts", "prompt"), "prompt") from None
        ids = [self._checked(loop, i, parsed, w) for i, w in zip(ids, names)]
        check_tokens(self.config, list(map(len, ids)), parsed.params.n,
                     parsed.params.max_new_tokens)
        self._check_grammar(loop, parsed)
        echo = None
        if parsed.echo:  # a prompt's own text, or its ids decoded; one entry per choice
            decode = tokenizer.decode if tokenizer else lambda ids: ""
            echo = [(p if isinstance(p, str) else decode(i), i) for p, i in zip(prompts, ids)
                    for _ in range(parsed.params.n)]
        return Prepared(parsed, ids, echo)

    def chat(self, raw: bytes) -> Prepared:
        """``POST /v1/chat/completions``."""
        body, loop = self._body(raw)
        body = check_fields(body, CHAT_FIELDS)
        messages = chat_messages(body.get("messages"))
        try:
            ids = chat_prompt_ids(self._intake.tokenizer(), messages)
        except Exception as e:  # a template may raise anything on a conversation it refuses
            raise bad(f"messages: {e}", "messages") from None
        limit = max_model_len(loop.engine)
        asked = body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None
        if len(ids) >= limit and not asked:
            raise APIError(400, f"messages ({len(ids)} tokens) leave no room for an answer in the "
                                f"{limit} tokens of the context (or the KV pool)", "messages",
                           code="context_length_exceeded")
        parsed = parse_chat(body, max(1, limit - len(ids)))
        ids = self._checked(loop, ids, parsed, "messages")
        params = parsed.params
        check_sequences(self.config, 1, params.n, loop.max_queued_requests, "messages")
        check_tokens(self.config, [len(ids)], params.n, params.max_new_tokens, "messages")
        self._check_grammar(loop, parsed)
        return Prepared(parsed, [ids])

    def tokenize(self, raw: bytes) -> dict[str, Any]:
        """``POST /tokenize``."""
        body, loop = self._body(raw)
        return tokenize(body, self._intake.tokenizer(), max_model_len(loop.engine))

    def detokenize(self, raw: bytes) -> dict[str, Any]:
        """``POST /detokenize``."""
        body, loop = self._body(raw)
        return detokenize(body, self._intake.tokenizer(), loop.engine.model_config.vocab_size)

    @staticmethod
    def _checked(loop: EngineLoop, ids: list[int], parsed: ParsedRequest, where: str
                 ) -> list[int]:
        try:
            check_request(ids, parsed.params, loop.engine.limits, where)
        except ValueError as e:
            raise parsed.error(e, where.split("[")[0]) from None
        return ids

    @staticmethod
    def _check_grammar(loop: EngineLoop, parsed: ParsedRequest) -> None:
        """Compile the request's grammar, if any (the engine keeps it for the request's
        matcher): a bad or unsatisfiable one is a 400 before anything is queued."""
        if parsed.params.grammar is not None:
            try:
                loop.engine.check_grammar(parsed.params)
            except ValueError as e:
                raise parsed.error(e) from None
