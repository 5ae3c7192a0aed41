"""The work one request may queue: its sequences (prompts x n) and its tokens (each sequence's
prompt and max_tokens), bounded by the server's flags. A request past a bound gets a 400
naming it (``code: "request_too_large"``): retrying cannot help, so never the 503 of a full
queue."""

from __future__ import annotations

from minijax_serve.server.protocol import APIError
from minijax_serve.server.server_config import ServerConfig


def _too_large(message: str, param: str) -> APIError:
    return APIError(400, message, param, code="request_too_large")


def check_sequences(config: ServerConfig, num_prompts: int, n: int, max_queued: int | None,
                    param: str = "prompt") -> None:
    """``num_prompts`` x ``n`` within ``--max-request-sequences`` and the queue's bound
    ``max_queued`` (``--max-queued-requests``); ``param`` names the prompts' field."""
    sequences = num_prompts * n
    what = f"{num_prompts} prompt(s) x n={n} = {sequences} sequences"
    param = "n" if n > 1 else param
    if sequences > config.max_request_sequences:
        raise _too_large(f"{what}: more than the {config.max_request_sequences} one request may "
                         f"queue on this server (--max-request-sequences)", param)
    if max_queued is not None and sequences > max_queued:
        raise _too_large(f"{what}: more than the {max_queued} the server's queue holds "
                         f"(--max-queued-requests)", param)


def check_tokens(config: ServerConfig, prompt_lengths: list[int], n: int, max_tokens: int,
                 param: str = "prompt") -> None:
    """The tokens the request may queue, (prompt + ``max_tokens``) x ``n`` summed over its
    prompts, within ``--max-request-tokens``."""
    total = sum(length + max_tokens for length in prompt_lengths) * n
    param = "n" if n > 1 else param
    if total > config.max_request_tokens:
        raise _too_large(f"the request may queue {total} tokens (prompt + max_tokens, x n={n}, "
                         f"over {len(prompt_lengths)} prompt(s)): more than the "
                         f"{config.max_request_tokens} one request may queue on this server "
                         f"(--max-request-tokens)", param)
