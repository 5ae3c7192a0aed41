"""PrefillAdder: admits waiting requests into one prefill batch until a budget runs out."""

from __future__ import annotations

from minijax_serve.memory import PageAllocator, PrefixCache
from minijax_serve.request import Req


def reserved_pages(req: Req, allocator: PageAllocator, new_token_ratio: float, held: int) -> int:
    """Pages ``req`` may still need beyond the ``held`` pages it has (own or borrowed from the
    prefix cache): its uncomputed tokens now, plus ``new_token_ratio`` × its remaining
    max_new_tokens for future decode steps."""
    future = int(new_token_ratio * req.remaining_new_tokens)
    return max(0, allocator.pages_for(req.seq_len + future) - held)


class PrefillAdder:
    """Budgets of one prefill step: new tokens, running requests and KV pages.

    The KV check is SGLang's adaptive rule: free pages plus evictable prefix-cache pages must
    cover every admitted request's uncached tokens plus a reserve of ``new_token_ratio`` ×
    remaining max_new_tokens for each running and admitted request. The pool is read live at
    each ``try_add``, after the caller has locked the request's cached prefix (locked pages are
    no longer evictable); pages are allocated only after the last ``try_add`` of the step.
    """

    def __init__(self, *, allocator: PageAllocator, cache: PrefixCache, running: list[Req],
                 max_running: int, max_prefill_tokens: int, new_token_ratio: float):
        self.allocator = allocator
        self.cache = cache
        self.ratio = new_token_ratio
        self.token_budget = max_prefill_tokens
        self.seats_left = max_running - len(running)
        self.reserved = sum(reserved_pages(r, allocator, new_token_ratio, len(r.pages)) for r in running)
        self.admitted: list[Req] = []

    def try_add(self, req: Req, cached_len: int) -> bool:
        """Admit ``req``, whose first ``cached_len`` tokens are cached (and locked), if it fits
        every budget (a prompt longer than the token budget fits alone, first in line)."""
        new_tokens = req.seq_len - cached_len
        pages = reserved_pages(req, self.allocator, self.ratio, cached_len // self.allocator.page_size)
        available = self.allocator.num_free + self.cache.evictable_size // self.allocator.page_size
        if self.seats_left < 1 or pages > available - self.reserved:
            return False
        if new_tokens > self.token_budget and self.admitted:
            return False
        self.admitted.append(req)
        self.seats_left -= 1
        self.token_budget -= new_tokens
        self.reserved += pages
        return True
