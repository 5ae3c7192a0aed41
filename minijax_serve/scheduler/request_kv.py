"""RequestKV: a request's KV pages and slot against the page allocator, the prefix cache and the
slot table: admission onto a cached prefix, pages handed to the cache during and after a
prefill, eviction to make room, the pages a decode step's next tokens lack, and freeing.

The scheduler decides who runs; this keeps the books of what each holder owns (every page in
exactly one of: free, the prefix cache, one holder's private pages; see
:func:`minijax_serve.scheduler.invariants.check_ledgers`).
"""

from __future__ import annotations

import numpy as np

from minijax_serve.core.request import Req
from minijax_serve.memory import PageAllocator, PrefixCache, PrefixMatch, RequestSlots, SlotTable


class RequestKV:
    """The KV ledgers of the requests holding slots; counts the tokens admissions took from
    the prefix cache and the pages evicted from it."""

    def __init__(self, allocator: PageAllocator, slots: RequestSlots, table: SlotTable,
                 cache: PrefixCache, eos_ids: frozenset[int]):
        self.allocator = allocator
        self.slots = slots
        self.table = table
        self.cache = cache
        self.eos_ids = eos_ids
        self.evicted_pages = 0
        self.cached_tokens = 0  # tokens admissions took from the prefix cache instead of computing

    def cache_ahead(self, req: Req, n: int) -> None:
        """Hand the whole pages ``req`` computes in this step to the prefix cache now, before the
        step runs, so the requests admitted after it in the same step borrow them instead of
        computing them again: in each layer every new token's K/V is written to the pool before
        that layer's attention reads any prefix. Not when the cache already holds more of those
        tokens than ``req`` borrows (their pages are computed twice this step, the duplicates
        freed after it, as before)."""
        ps = self.allocator.page_size
        whole = (req.kv_len + n) // ps * ps
        if whole > req.prefix_len and self.cache.match_prefix(
                req.token_ids(0, whole)).length == req.prefix_len:
            self.cache_prefill(req, whole)

    def admit(self, req: Req, match: PrefixMatch, new_pages: int) -> None:
        """Give an admitted request its slot, the cached prefix (locked by the caller) and
        ``new_pages`` private pages; its prefill starts after the prefix."""
        assert match.length == len(match.pages) * self.allocator.page_size, "prefix not page-aligned"
        req.slot = self.slots.alloc()
        req.pages = match.pages + self.allocator.alloc(new_pages)
        req.prefix_node, req.prefix_len = match.node, match.length
        req.kv_len = match.length  # writes start on the first private page
        if not req.num_retracted:
            req.cached_tokens = match.length
        self.cached_tokens += match.length
        self.table.admit(req, self.eos_ids)

    def missing_pages(self, reqs: list[Req]) -> np.ndarray:
        """Pages each of ``reqs`` lacks for its next token (0 or 1)."""
        rows = np.array([r.slot for r in reqs], np.int32)
        need = -(-self.table.seq_len[rows] // self.allocator.page_size) - self.table.num_pages[rows]
        return np.maximum(need, 0)

    def make_free(self, num_pages: int) -> None:
        """Evict prefix-cache pages until ``num_pages`` pages are free (the budgets guarantee
        that enough of them are evictable)."""
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.evicted_pages += self.cache.evict(short)

    def cache_prefill(self, req: Req, upto: int | None = None) -> None:
        """Hand the whole pages of a holder's first ``upto`` tokens (default: those computed)
        to the prefix cache; the request borrows them from now on (its next writes are past
        them)."""
        upto = req.kv_len if upto is None else upto
        match = self.cache.cache_unfinished(req.token_ids(0, upto), req.pages)
        self.cache.lock(match.node)
        self.cache.unlock(req.prefix_node)
        req.pages[:len(match.pages)] = match.pages
        req.prefix_node, req.prefix_len = match.node, match.length
        self.table.set_pages(req)
        assert req.prefix_len <= upto

    def free(self, req: Req) -> None:
        """Give ``req``'s pages to the prefix cache (the tokens on the host whose KV is written
        or being written) and free its slot; its pending tokens are dropped."""
        req.num_pending = 0
        self.cache.unlock(req.prefix_node)
        self.cache.cache_finished(req.token_ids(0, min(req.kv_len, req.seq_len)), req.pages)
        self.slots.free(req.slot)
        req.pages, req.slot, req.token_in_buffer = [], None, False
        req.prefix_node, req.prefix_len = None, 0

    def pages_short(self, missing: np.ndarray) -> int:
        """Pages the next tokens need (``missing`` per request) beyond free and evictable ones."""
        return (int(missing.sum()) - self.allocator.num_free
                - self.cache.evictable_size // self.allocator.page_size)

    def grow(self, reqs: list[Req], missing: np.ndarray) -> list[Req]:
        """Give each of ``reqs`` the ``missing`` pages of its next token (evicting first; the
        caller checked :meth:`pages_short`); returns them longest first (the attention walks
        each chunk of sequences to its longest prefix)."""
        self.make_free(int(missing.sum()))
        for i in np.flatnonzero(missing).tolist():
            req = reqs[i]
            req.pages += self.allocator.alloc(int(missing[i]))
            self.table.set_pages(req)
        rows = np.array([r.slot for r in reqs], np.int32)
        return [reqs[i] for i in np.argsort(-self.table.seq_len[rows], kind="stable").tolist()]

    def grow_drafts(self, reqs: list[Req], drafts: list[list[int]]) -> list[list[int]] | None:
        """Pages for the drafts each of ``reqs`` verifies in a decode step (beyond its next
        token's, which it has): each request's drafts, in order, cut to what the free pages hold
        (the prefix cache is not evicted for them); None if no request keeps a draft."""
        kept = []
        for req, d in zip(reqs, drafts):
            while d and (self.allocator.pages_for(req.seq_len + len(d)) - len(req.pages)
                         > self.allocator.num_free):
                d = d[:-1]
            need = self.allocator.pages_for(req.seq_len + len(d)) - len(req.pages)
            if need > 0:
                req.pages += self.allocator.alloc(need)
                self.table.set_pages(req)
            kept.append(d)
        return kept if any(kept) else None

    def commit_drafts(self, req: Req, extra: int) -> None:
        """A verify's outcome: ``extra`` tokens past the request's last one were taken (the KV
        of the accepted drafts is written); its pages past its sequence go back (a rejected
        draft's KV is never read: later steps overwrite it), and its last token is known on the
        host only (the verify sampled into no token-buffer row)."""
        req.kv_len += extra
        s = req.slot
        self.table.kv_len[s], self.table.seq_len[s] = req.kv_len, req.seq_len
        req.token_in_buffer = self.table.in_buffer[s] = False
        keep = self.allocator.pages_for(req.seq_len)
        if len(req.pages) > keep:
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]
            self.table.set_pages(req)
