"""What the engine loop (:mod:`minijax_serve.server.engine_loop`) hands out: each choice's
:class:`Delta` (by its :class:`Route`), an :class:`EngineFault`, the :class:`LoadSnapshot` of
/metrics, and what it tells its :class:`Observer`."""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple, Protocol


class Route(NamedTuple):
    """Where one engine request's outputs go: its handler's queue, as which choice."""

    queue: asyncio.Queue
    choice: int
    stream: bool  # a Delta per step; else one Delta with everything when it finishes
    first: bool = True  # no token delivered yet


class Delta(NamedTuple):
    """What one sample (choice) of a request added since its previous Delta."""

    choice: int  # index among the HTTP request's choices: prompt index * n + sample index
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int  # so far
    # the sample's first Delta with tokens (or its last): the prompt's logprobs, if asked
    prompt_logprobs: list[dict[int, float] | None] | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (once admitted)
    weights_version: int = 0  # of the weights its newest token came from (update_weights)


class EngineFault(NamedTuple):
    """The engine failed while running this request (HTTP 500)."""

    message: str


class LoadSnapshot(NamedTuple):
    """The engine's load, published by the loop after every step (for /metrics)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    cache_hit_rate: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    spec_proposed_tokens: int = 0  # speculative decoding's drafts verified
    spec_accepted_tokens: int = 0  # and accepted
    spec_verified_seqs: int = 0  # verifies (a sequence's drafts in a step)


class Observer(Protocol):
    """What the loop reports, sequence by sequence (the server's metrics)."""

    def observe(self, out: Any) -> None:
        """An output handed over (called on the loop's thread)."""

    def submitted(self, count: int) -> None:
        """``count`` sequences were added to the engine."""

    def failed(self, count: int) -> None:
        """``count`` sequences ended with an engine fault (their outputs go nowhere)."""
