"""PrefillAdder: admits waiting requests into one prefill step until a budget runs out."""

from __future__ import annotations

import numpy as np

from minijax_serve.core.request import Req
from minijax_serve.memory import PageAllocator, PrefixCache, SlotTable
from minijax_serve.scheduler.peak_pages import FutureNeed

CLIP_MAX_NEW_TOKENS = 4096  # SGLang's cap on one request's reserve for future decode tokens


def decode_reserve(new_token_ratio: float, remaining):
    """Future decode tokens reserved for requests with ``remaining`` max_new_tokens left (an int
    or an array): ``new_token_ratio`` × the remainder, clipped as SGLang does."""
    return (new_token_ratio * np.minimum(remaining, CLIP_MAX_NEW_TOKENS)).astype(np.int64)


def reserved_pages(req: Req, allocator: PageAllocator, new_token_ratio: float, held: int) -> int:
    """Pages ``req`` may still need beyond the ``held`` pages it has (own or borrowed from the
    prefix cache): its uncomputed tokens now, plus :func:`decode_reserve` for future decode
    steps."""
    future = int(decode_reserve(new_token_ratio, req.remaining_new_tokens))
    return max(0, allocator.pages_for(req.seq_len + future) - held)


def holders_reserved_pages(table: SlotTable, slots: np.ndarray, page_size: int,
                           new_token_ratio: float) -> int:
    """:func:`reserved_pages` summed over the requests holding ``slots``, from the slot table."""
    seq = table.seq_len[slots]
    future = decode_reserve(new_token_ratio, table.remaining_new_tokens(slots))
    return int(np.maximum(-(-(seq + future) // page_size) - table.num_pages[slots], 0).sum())


class PrefillAdder:
    """Budgets of one prefill step, checked request by request.

    * tokens: whole requests up to ``max_prefill_tokens`` (the first one always fits), and at most
      ``chunk_tokens`` new tokens in the step (None: no limit). A request past the chunk budget
      gets a page-aligned first chunk and ends the step: it is the step's chunked request.
    * seats: ``max_running`` minus the requests holding a slot (``holders``).
    * KV, SGLang's adaptive rule: free pages plus evictable prefix-cache pages must cover each
      admitted request's uncached tokens (its whole prompt, even when chunked) plus a reserve of
      ``new_token_ratio`` × remaining max_new_tokens for it and for every holder. The pool is read
      live at each ``try_add``, after the caller has locked the request's cached prefix (locked
      pages are no longer evictable); pages are allocated after the last ``try_add`` of the step.
    * KV, exactly, for an ``ignore_eos`` request when ``exact_ignore_eos``: such a request
      writes exactly its remaining max_new_tokens and then ends, so the future is known. It is
      admitted only if the pool can hold, at every future step, the holders, the requests
      admitted so far and itself (:class:`~minijax_serve.scheduler.peak_pages.FutureNeed`, one token per decode step from now).
      A request that ends gives back the pages no other holder or admitted request shares (a
      shared prefix stays locked). Counted as keeping their pages to the end: a request that may
      stop at EOS (it grows by ``new_token_ratio`` × its remaining tokens), and a prompt still
      prefilled in chunks (with mixed batches the others decode meanwhile, so it finishes later
      than its remaining tokens say). When every request is ``ignore_eos``, such admissions never
      need a retract.
    """

    def __init__(self, *, allocator: PageAllocator, cache: PrefixCache, holders: list[Req],
                 table: SlotTable, max_running: int, max_prefill_tokens: int,
                 chunk_tokens: int | None, new_token_ratio: float, exact_ignore_eos: bool,
                 chunked: Req | None):
        self.allocator = allocator
        self.cache = cache
        self.ratio = new_token_ratio
        self.token_budget = max_prefill_tokens
        self.chunk_budget = chunk_tokens
        self.seats_left = max_running - len(holders)
        slots = np.array([r.slot for r in holders], np.int32)
        self.reserved = holders_reserved_pages(table, slots, allocator.page_size, new_token_ratio)
        self.num_in_step = 0  # requests given tokens in this step
        self.exact_ignore_eos = exact_ignore_eos
        self.table, self.holder_slots = table, slots
        self.chunked_slot = -1 if chunked is None else chunked.slot
        self._need: FutureNeed | None = None  # the exact admissions' future, once needed
        # (request, its pages the cache owns, pages it holds, whole prompt in this step)
        self.admitted: list[tuple[Req, list[int], int, bool]] = []

    def _member(self, admitted: tuple[Req, list[int], int, bool]) -> tuple:
        """:class:`FutureNeed`'s member of an admitted request (request, its pages the cache
        owns, pages it holds, whole prompt in this step)."""
        req, pages, held, whole = admitted
        remaining = req.remaining_new_tokens
        ignore_eos = req.params.ignore_eos
        left = remaining if ignore_eos else int(decode_reserve(self.ratio, remaining))
        return req.seq_len, held, left, ignore_eos and whole, pages

    def _future(self) -> FutureNeed:
        """The future need of the holders (from the slot table) and the requests admitted so
        far, made on the first exact admission of the step. A request that may stop at EOS
        grows by ``new_token_ratio`` × its remaining tokens and keeps its pages; so does a
        prompt still prefilled in chunks (module docstring)."""
        if self._need is None:
            t, s, ps = self.table, self.holder_slots, self.allocator.page_size
            cached = (t.prefix_len[s] // ps).astype(np.int64)
            rows = t.pages[s, :int(cached.max(initial=0))]
            mine = np.arange(rows.shape[1]) < cached[:, None]
            remaining = t.remaining_new_tokens(s).astype(np.int64)
            ignore_eos = t.ignore_eos[s].astype(bool)
            left = np.where(ignore_eos, remaining, decode_reserve(self.ratio, remaining))
            self._need = FutureNeed(ps, t.seq_len[s], t.num_pages[s], left,
                                    ignore_eos & (s != self.chunked_slot), rows[mine],
                                    np.repeat(np.arange(len(s)), cached))
            for admitted in self.admitted:
                self._need.add(*self._member(admitted))
        return self._need

    def _chunk(self, new_tokens: int) -> int:
        """New tokens of a request this step under the chunk budget (0: none fit)."""
        if self.chunk_budget is None or new_tokens <= self.chunk_budget:
            return new_tokens
        return max(0, self.chunk_budget // self.allocator.page_size * self.allocator.page_size)

    def _take(self, tokens: int) -> None:
        self.token_budget -= tokens
        if self.chunk_budget is not None:
            self.chunk_budget -= tokens

    def add_chunked(self, req: Req) -> int:
        """New tokens this step for the request carried over mid-prefill (its KV was budgeted
        at admission and its pages are allocated)."""
        n = self._chunk(req.seq_len - req.kv_len)
        self.num_in_step += n > 0
        self._take(n)
        return n

    def try_add(self, req: Req, cached_pages: list[int]) -> int:
        """Admit ``req``, whose prefix held in ``cached_pages`` is cached (and locked), if it fits
        every budget; returns its new tokens this step (fewer than uncached: a first chunk), or 0
        if it does not fit."""
        ps = self.allocator.page_size
        new_tokens = req.seq_len - len(cached_pages) * ps
        pages = reserved_pages(req, self.allocator, self.ratio, len(cached_pages))
        available = self.allocator.num_free + self.cache.evictable_size // ps
        n = self._chunk(new_tokens)
        if self.seats_left < 1 or n <= 0 or (new_tokens > self.token_budget and self.num_in_step):
            return 0
        admitted = (req, cached_pages, len(cached_pages), n == new_tokens)
        if self.exact_ignore_eos and req.params.ignore_eos:
            if self._future().peak_with(*self._member(admitted)) > available:
                return 0
        elif pages > available - self.reserved:
            return 0
        self.num_in_step += 1
        self.seats_left -= 1
        self._take(n)
        self.reserved += pages
        self.admitted.append(admitted)
        if self._need is not None:
            self._need.add(*self._member(admitted))
        return n

    def allocated(self, req: Req, new_pages: int) -> None:
        """``req``, the last admitted, now holds its prompt's ``new_pages`` pages (and may have
        handed the whole pages it computes in this step to the cache, for the requests after it
        to borrow): they are held, no longer reserved."""
        self.reserved -= new_pages
        _, before, _, whole = self.admitted[-1]
        owned = req.pages[:req.prefix_len // self.allocator.page_size]
        self.admitted[-1] = (req, owned, len(req.pages), whole)
        if self._need is not None and not (owned[:len(before)] == list(before) and
                                           self._need.allocated(new_pages, owned[len(before):])):
            self._need = None  # pages it shares with others changed: made anew when needed
