"""Adaptive admission and its safety valve: the new-token ratio and the retract order.

Admission reserves KV for ``ratio`` × each request's remaining max_new_tokens, not all of it:
most requests stop early (EOS) or are far from their limit, so a full reserve leaves the pool
mostly empty. The ratio starts low-ish, decays while nothing goes wrong (admit more), and jumps
up after a retract (a decode step found the pool exhausted and had to send requests back).
"""

from __future__ import annotations

from typing import Sequence

from minijax_serve.config.names import RETRACT_POLICIES
from minijax_serve.core.request import Req


class NewTokenRatio:
    """SGLang's ``new_token_ratio``: linear decay per decode step from ``init`` to ``minimum``
    over ``decay_steps`` steps; after a retract, the running batch's decoded share of its
    max_new_tokens plus ``retract_decode_steps`` tokens per request (capped at 1); ``init`` again
    when the engine goes idle."""

    def __init__(self, init: float, minimum: float, decay_steps: int, retract_decode_steps: int):
        self.init, self.minimum = init, minimum
        self.decay = (init - minimum) / decay_steps
        self.retract_decode_steps = retract_decode_steps
        self.value = init

    def on_decode_step(self) -> None:
        self.value = max(self.value - self.decay, self.minimum)

    def on_retract(self, running: Sequence[Req]) -> None:
        total = sum(r.params.max_new_tokens for r in running)
        if total:
            decoded = sum(len(r.output_ids) for r in running)
            self.value = min(1.0, (decoded + self.retract_decode_steps * len(running)) / total)

    def reset(self) -> None:
        self.value = self.init


def retract_order(running: Sequence[Req], policy: str) -> list[Req]:
    """The running requests in the order they are retracted: ``length`` takes the fewest
    generated tokens first (least work lost), ties the longest prompt (most KV freed); ``fcfs``
    takes the latest arrival first."""
    if policy == "length":
        return sorted(running, key=lambda r: (len(r.output_ids), -len(r.prompt_ids)))
    if policy == "fcfs":
        return sorted(running, key=lambda r: r.arrival_time, reverse=True)
    raise ValueError(f"retract_policy must be one of {', '.join(RETRACT_POLICIES)}, got {policy!r}")


def forced_retract_pick(decodable: Sequence[Req], policy: str) -> Req | None:
    """The request ``force_retract_every`` retracts: the first in ``policy`` order of those that
    were never retracted or got a token to the host since. Without that rule a request retracted
    while its re-prefill's token is still on its way (overlap) could be picked every step."""
    progressed = [r for r in decodable if len(r.output_ids) > r.outputs_at_retract]
    return retract_order(progressed, policy)[0] if progressed else None
