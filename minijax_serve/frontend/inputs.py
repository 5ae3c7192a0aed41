"""Request intake: prompts, chat conversations and sampling parameters checked against the
engine's limits, before anything is queued. Every error is a ValueError naming the field (and
the prompt's index) and the limit."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Sequence

import numpy as np

from minijax_serve.config import EngineConfig
from minijax_serve.core.sampling_params import SamplingParams
from minijax_serve.memory.slot_table import MAX_BANNED_TOKENS

Prompt = str | Sequence[int]
Message = Mapping[str, str]


class RequestLimits(NamedTuple):
    """What one request may ask of the engine."""

    context_length: int
    pool_tokens: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    config: EngineConfig
    has_tokenizer: bool


def _is_single_prompt(prompts: Any) -> bool:
    """``prompts`` is one prompt (a string or a flat list of ids), not a list of prompts."""
    if isinstance(prompts, str):
        return True
    return isinstance(prompts, (list, tuple, np.ndarray)) and len(prompts) > 0 and not isinstance(
        prompts[0], (str, list, tuple, np.ndarray))


def prompt_list(prompts: Any) -> tuple[list[Any], list[str]]:
    """One prompt or a list of them -> (the prompts, how each is named in errors)."""
    if _is_single_prompt(prompts):
        return [prompts], ["prompt"]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt (a str or a list of token ids) or a list of "
                         f"prompts, got {type(prompts).__name__}")
    return list(prompts), [f"prompts[{i}]" for i in range(len(prompts))]


def params_list(params: Any, count: int) -> list[SamplingParams]:
    """``sampling_params`` (None, one, or one per prompt) -> one per prompt, each checked."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, (list, tuple)):
        raise ValueError(f"sampling_params must be SamplingParams or a list of them, got "
                         f"{type(params).__name__}")
    if len(params) != count:
        raise ValueError(f"sampling_params: got {len(params)} for {count} prompts")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise ValueError(f"sampling_params[{i}] must be SamplingParams, got {type(p).__name__}")
    return list(params)


def prompt_ids(prompt: Any, where: str, tokenizer: Any, vocab_size: int) -> list[int]:
    """The token ids of one prompt (text is tokenized); ``where`` names it in errors."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{where}: text prompts need a tokenizer (the engine was made with "
                             "skip_tokenizer_init=True); pass token ids")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        for j, t in enumerate(prompt):
            if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)):
                raise ValueError(f"{where}[{j}] must be a token id (an int), got {t!r}; a prompt "
                                 "is a str or a list of token ids")
        ids = [int(t) for t in prompt]
    else:
        raise ValueError(f"{where} must be a str or a list of token ids, got "
                         f"{type(prompt).__name__}")
    if not ids:
        raise ValueError(f"{where} is empty: it must have at least 1 token")
    for j, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"{where}[{j}]: token id {t} is outside the vocabulary "
                             f"[0, {vocab_size})")
    return ids


@contextlib.contextmanager
def naming(where: str | None) -> Iterator[None]:
    """Start the message of a ValueError raised inside with ``where: `` (None: as it is)."""
    try:
        yield
    except ValueError as e:
        if where is None:
            raise
        raise ValueError(f"{where}: {e}") from None


def checked_requests(prompts: Any, sampling_params: Any, tokenizer: Any, limits: RequestLimits,
                     ) -> list[tuple[list[int], SamplingParams, str | None]]:
    """(token ids, SamplingParams, name) of every prompt, each checked against ``limits``
    before any is queued. The name starts the errors about the prompt's parameters: the
    prompt's (``prompts[2]``) when each prompt has its own SamplingParams, else None."""
    prompts, names = prompt_list(prompts)
    params = params_list(sampling_params, len(prompts))
    ids = [prompt_ids(p, where, tokenizer, limits.vocab_size) for p, where in zip(prompts, names)]
    owners = names if isinstance(sampling_params, (list, tuple)) else [None] * len(names)
    for i, p, where, owner in zip(ids, params, names, owners):
        check_request(i, p, limits, where, owner)
    return list(zip(ids, params, owners))


def check_request(ids: list[int], params: SamplingParams, limits: RequestLimits,
                  where: str = "prompt", params_of: str | None = None) -> None:
    """Raise ValueError if the request cannot run on an engine with ``limits``; ``where``
    names the prompt in errors about its length, ``params_of`` starts those about its
    parameters (see :func:`checked_requests`)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
    total = len(ids) + params.max_new_tokens
    for limit, name in ((limits.context_length, "the context length"),
                        (limits.pool_tokens, "the KV pool")):
        if total > limit:
            raise ValueError(f"{where} ({len(ids)} tokens) + max_new_tokens "
                             f"({params.max_new_tokens}) = {total} exceeds {name} ({limit} tokens)")
    with naming(params_of):
        check_params(params, limits)


def check_config_limits(params: SamplingParams, config: EngineConfig) -> None:
    """The checks of ``params`` against the engine's configuration alone (the CLI makes them
    before it loads the model; a limit the device sizes, left None, is checked by the engine)."""
    if config.max_running_requests is not None and params.n > config.max_running_requests:
        raise ValueError(f"n must be <= max_running_requests={config.max_running_requests}, "
                         f"got {params.n}")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > config.max_logprobs:
            raise ValueError(f"{name} must be <= max_logprobs={config.max_logprobs}, got {value}")


def check_params(params: SamplingParams, limits: RequestLimits) -> None:
    """The checks of :func:`check_request` that do not depend on the prompt."""
    vocab = limits.vocab_size
    outside = [t for t in params.stop_token_ids if t >= vocab]
    if outside:
        raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {outside[0]}")
    outside = [t for t, _ in params.logit_bias if t >= vocab]
    if outside:
        raise ValueError(f"logit_bias: token ids must be in [0, {vocab}), got {outside[0]}")
    banned = len(set(limits.eos_ids) | set(params.stop_token_ids))
    if params.min_new_tokens > 0 and banned > MAX_BANNED_TOKENS:
        raise ValueError(f"stop_token_ids: with min_new_tokens > 0 at most {MAX_BANNED_TOKENS} "
                         f"stop and EOS tokens can be masked, got {banned}")
    if params.stop and not limits.has_tokenizer:
        raise ValueError("stop: stop strings need a tokenizer (the engine was made with "
                         "skip_tokenizer_init=True)")
    check_config_limits(params, limits.config)


def conversation_list(conversations: Any) -> list[list[Message]]:
    """One conversation (a list of messages) or a list of them -> a list of conversations,
    each checked: a non-empty list of mappings with a string ``role`` and ``content``."""
    if isinstance(conversations, (list, tuple)) and conversations and all(
            isinstance(c, (list, tuple)) for c in conversations):
        convs, names = list(conversations), [f"messages[{i}]" for i in range(len(conversations))]
    else:
        convs, names = [conversations], ["messages"]
    for conv, name in zip(convs, names):
        if not isinstance(conv, (list, tuple)):
            raise ValueError(f"{name} must be a list of messages ({{'role': ..., 'content': ...}}),"
                             f" got {type(conv).__name__}")
        if not conv:
            raise ValueError(f"{name} is an empty conversation: it needs at least one message")
        for j, msg in enumerate(conv):
            if not isinstance(msg, Mapping):
                raise ValueError(f"{name}[{j}] must be a mapping with 'role' and 'content', got "
                                 f"{type(msg).__name__}")
            for key in ("role", "content"):
                if not isinstance(msg.get(key), str):
                    raise ValueError(f"{name}[{j}]['{key}'] must be a string, got "
                                     f"{msg.get(key)!r}")
    return [list(c) for c in convs]


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False) -> list[int]:
    """One conversation through the model's chat template, by default ending with the
    generation prompt and without the tokenizer's special tokens (the template has its BOS)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer (the engine was made with "
                         "skip_tokenizer_init=True)")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat: the model's tokenizer has no chat template")
    text = tokenizer.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
