"""SlotTable: what each request slot holds, as numpy rows, so a batch lowers by gathers.

The scheduler keeps each request's ledger on the request (its pages, KV length, parameters) and
mirrors it here where it changes: admission, new pages, a launched step. Lowering a batch then
indexes these rows by the requests' slots instead of reading every request's fields every step,
which is what keeps a decode tick of hundreds of requests cheap. SGLang keeps the same per-slot
rows on the device (``req_to_token`` and the sampling tensors of the running batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np

from minijax_serve.memory.page_allocator import SCRATCH_PAGE

if TYPE_CHECKING:
    from minijax_serve.core.request import Req

MAX_BANNED_TOKENS = 8  # EOS + stop_token_ids masked while min_new_tokens is not reached


class SlotTable:
    """Rows indexed by request slot; the last row is the scratch slot's (padding sequences)."""

    def __init__(self, num_slots: int, max_pages: int):
        n = num_slots + 1
        self.pages = np.full((n, max_pages), SCRATCH_PAGE, np.int32)  # the page table
        self.num_pages = np.zeros(n, np.int32)
        self.prefix_len = np.zeros(n, np.int32)  # tokens of the leading pages borrowed from the cache
        self.kv_len = np.zeros(n, np.int32)  # tokens whose KV is written (or being written)
        self.seq_len = np.zeros(n, np.int32)  # prompt + output tokens, pending ones included
        self.prompt_len = np.zeros(n, np.int32)
        self.in_buffer = np.zeros(n, bool)  # the last output token sits in the device token buffer
        self.temperature = np.zeros(n, np.float32)
        self.top_k = np.full(n, -1, np.int32)
        self.top_p = np.ones(n, np.float32)
        self.min_p = np.zeros(n, np.float32)
        self.seed = np.zeros(n, np.uint32)
        self.greedy = np.ones(n, bool)
        self.min_new = np.zeros(n, np.int32)
        self.max_new = np.zeros(n, np.int32)
        self.ignore_eos = np.zeros(n, bool)
        # repetition, frequency, presence; 1 where the slot's logit bias row applies
        self.penalties = np.tile(np.array([1, 0, 0, 0], np.float32), (n, 1))
        self.penalized = np.zeros(n, bool)
        self.logprobs = np.zeros(n, bool)  # the request asks for its tokens' log-probabilities
        self.banned = np.full((n, MAX_BANNED_TOKENS), -1, np.int32)  # -1: none

    def admit(self, req: Req, eos_ids: Iterable[int]) -> None:
        """Write every row of a request just given its slot, pages and KV length."""
        s, p = req.slot, req.params
        self.set_pages(req)
        self.kv_len[s], self.seq_len[s] = req.kv_len, req.seq_len
        self.prompt_len[s], self.in_buffer[s] = len(req.prompt_ids), req.token_in_buffer
        self.temperature[s], self.top_k[s], self.top_p[s] = p.temperature, p.top_k, p.top_p
        self.min_p[s], self.seed[s], self.greedy[s] = p.min_p, req.seed, p.greedy
        self.min_new[s], self.max_new[s] = p.min_new_tokens, p.max_new_tokens
        self.ignore_eos[s] = p.ignore_eos
        self.penalties[s] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty,
                             float(bool(p.logit_bias)))
        self.penalized[s], self.logprobs[s] = p.adjusts_logits, p.logprobs is not None
        self.banned[s] = -1
        if p.min_new_tokens:
            ban = list(dict.fromkeys(([] if p.ignore_eos else sorted(eos_ids)) + list(p.stop_token_ids)))
            self.banned[s, :len(ban)] = ban

    def set_pages(self, req: Req) -> None:
        row = self.pages[req.slot]
        row[:] = SCRATCH_PAGE
        row[:len(req.pages)] = req.pages
        self.num_pages[req.slot], self.prefix_len[req.slot] = len(req.pages), req.prefix_len

    def remaining_new_tokens(self, slots: np.ndarray) -> np.ndarray:
        """Output tokens the requests of ``slots`` may still generate (``Req.remaining_new_tokens``)."""
        return self.max_new[slots] - (self.seq_len[slots] - self.prompt_len[slots])

    def launched(self, slots: np.ndarray, new_tokens: np.ndarray, sampled: np.ndarray) -> None:
        """A step computing ``new_tokens`` for ``slots`` (distinct) was dispatched; the
        ``sampled`` ones get one more (pending) output token, which lands in the token buffer."""
        self.kv_len[slots] += new_tokens
        self.seq_len[slots[sampled]] += 1
        self.in_buffer[slots[sampled]] = True

    def check(self, req: Req) -> None:
        """Raise AssertionError if ``req``'s rows disagree with its own ledger."""
        s = req.slot
        mirrored = (self.kv_len[s] == req.kv_len and self.seq_len[s] == req.seq_len
                    and self.num_pages[s] == len(req.pages) and self.in_buffer[s] == req.token_in_buffer
                    and self.prefix_len[s] == req.prefix_len
                    and self.pages[s, :len(req.pages)].tolist() == req.pages)
        if not mirrored:
            raise AssertionError(f"the slot table's row {s} disagrees with request {req.rid}")
