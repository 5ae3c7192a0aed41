"""``/tokenize`` and ``/detokenize`` (vLLM's, also SGLang's): the served model's tokenizer over
HTTP, so that a client counts tokens, builds id prompts or reads ids back with exactly the
engine's tokenizer and chat template. Nothing reaches the engine loop.

``POST /tokenize``: ``{"prompt": str}`` (``add_special_tokens``, default true) or
``{"messages": [...]}`` through the chat template (``add_generation_prompt``, default true;
``add_special_tokens``, default false: the template has its own), optionally
``return_token_strs``; answers ``{"count", "max_model_len", "tokens", "token_strs"}``.
``POST /detokenize``: ``{"tokens": [ids]}``; answers ``{"prompt": text}``.
"""

from __future__ import annotations

from typing import Any

from minijax_serve.frontend.inputs import chat_prompt_ids, prompt_ids
from minijax_serve.server.messages import chat_messages
from minijax_serve.server.protocol import bad, check_fields

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be a boolean, got {value!r}", name)
    return value


def _tokenizer(tokenizer: Any) -> Any:
    if tokenizer is None:
        raise bad("this server has no tokenizer (the engine was made with "
                  "skip_tokenizer_init=True)")
    return tokenizer


def tokenize(body: Any, tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """The answer to a ``/tokenize`` body (an APIError 400 for a bad one)."""
    body = check_fields(body, TOKENIZE_FIELDS)
    tokenizer = _tokenizer(tokenizer)
    text = body.get("prompt") is not None  # null is absent, as OpenAI reads it
    if text == (body.get("messages") is not None):
        raise bad("give exactly one of prompt (a string) and messages (a chat)", "prompt")
    strs = _flag(body, "return_token_strs", False)
    if text:
        if body.get("add_generation_prompt") is not None:
            raise bad("add_generation_prompt applies to messages only", "add_generation_prompt")
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad(f"prompt must be a string, got {type(prompt).__name__}", "prompt")
        ids = tokenizer.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        messages = chat_messages(body["messages"])
        generation = _flag(body, "add_generation_prompt", True)
        special = _flag(body, "add_special_tokens", False)
        try:
            ids = chat_prompt_ids(tokenizer, messages, generation, special)
        except Exception as e:  # a template may raise anything on a conversation it refuses
            raise bad(f"messages: {e}", "messages") from None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if strs else None}


def detokenize(body: Any, tokenizer: Any, vocab_size: int) -> dict[str, Any]:
    """The answer to a ``/detokenize`` body (an APIError 400 for a bad one)."""
    body = check_fields(body, DETOKENIZE_FIELDS)
    tokenizer = _tokenizer(tokenizer)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise bad("tokens must be a list of token ids", "tokens")
    try:
        ids = prompt_ids(tokens, "tokens", None, vocab_size) if tokens else []
    except ValueError as e:
        raise bad(str(e), "tokens") from None
    return {"prompt": tokenizer.decode(ids)}
