"""What the scheduler emits each step (ScheduleBatch) and the knobs it runs by (SchedulerLimits)."""

from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np

from minijax_serve.core.request import Req
from minijax_serve.memory import SlotTable


class ScheduleBatch(NamedTuple):
    """One step: the first ``num_prefill`` requests prefill (a chunk, or all the rest of their
    prompt), the others decode one token, or verify ``drafts[i]`` (speculative decoding: their
    last token and the drafts, ``1 + len(drafts[i])`` new tokens)."""

    reqs: list[Req]
    new_tokens: list[int]  # tokens each request computes in this step
    num_prefill: int
    slots: np.ndarray  # [S] each request's slot
    samples: np.ndarray  # [S] bool: the request gets a token from this step (not a mid-prompt chunk)
    epochs: list[int]  # each request's epoch when scheduled: a retract since voids its token
    kv_starts: np.ndarray  # [S] each request's KV length before the step (its first new position)
    admitted: list[Req]  # requests given their slot in this step (the last of the prefills)
    drafts: list[list[int]] | None = None  # per request, the proposed tokens it verifies

    @classmethod
    def of(cls, reqs: list[Req], new_tokens: list[int], num_prefill: int, table: SlotTable,
           admitted: list[Req] | None = None,
           drafts: list[list[int]] | None = None) -> "ScheduleBatch":
        slots = np.array([r.slot for r in reqs], np.int32)
        kv_starts = table.kv_len[slots]
        samples = kv_starts + np.array(new_tokens, np.int32) == table.seq_len[slots]
        if drafts is not None:
            new_tokens = [n + len(d) for n, d in zip(new_tokens, drafts)]
        return cls(reqs, new_tokens, num_prefill, slots, samples, [r.epoch for r in reqs],
                   kv_starts, admitted or [], drafts)

    @property
    def kv_advance(self) -> list[int]:
        """Tokens each request's KV surely grows by in the step: its new tokens, but only the
        last token of a verify (what its drafts add is known once they are accepted)."""
        if self.drafts is None:
            return self.new_tokens
        return [n - len(d) for n, d in zip(self.new_tokens, self.drafts)]

    @property
    def is_prefill(self) -> bool:
        return self.num_prefill > 0

    @property
    def is_mixed(self) -> bool:
        return 0 < self.num_prefill < len(self.reqs)

    def prompt_rows(self) -> Iterator[tuple[int, int, int, int]]:
        """(row, its first token's offset, start, end) of each prefill that scores its prompt:
        its positions ``start..end-1`` each predict a prompt token."""
        offset = 0
        for i, (req, n) in enumerate(zip(self.reqs[:self.num_prefill], self.new_tokens)):
            if req.needs_prompt_logprobs:
                start = int(self.kv_starts[i])
                yield i, offset, start, min(start + n, len(req.prompt_ids) - 1)
            offset += n

    def prompt_targets(self, num_tokens: int) -> np.ndarray | None:
        """Each new token's next prompt token [num_tokens], if a prefill scores its prompt."""
        targets = None
        for i, offset, start, end in self.prompt_rows():
            if targets is None:
                targets = np.zeros(num_tokens, np.int32)
            targets[offset:offset + end - start] = self.reqs[i].prompt_ids[start + 1:end + 1]
        return targets

    @property
    def constrained(self) -> bool:
        """A request of the batch samples under a grammar (its next mask needs this token)."""
        return any(r.grammar is not None for r, s in zip(self.reqs, self.samples.tolist()) if s)


class SchedulerLimits(NamedTuple):
    """The scheduler's knobs (from EngineConfig)."""

    max_running: int
    max_prefill_tokens: int
    chunk_tokens: int | None  # new tokens per step under chunked prefill; None: off
    mixed: bool  # decode tokens ride along in prefill steps (only with chunking)
    retract_policy: str
    force_retract_every: int  # decode steps; 0: off
    exact_ignore_eos: bool  # admit ignore_eos requests by their exact future, not the ratio
