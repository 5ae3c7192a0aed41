"""PrefillAdder: admits waiting requests into one prefill batch until a budget runs out."""

from __future__ import annotations

from minijax_serve.memory import PageAllocator
from minijax_serve.request import Req


def reserved_pages(req: Req, allocator: PageAllocator, new_token_ratio: float) -> int:
    """Pages ``req`` may still need beyond those it owns: its uncomputed tokens now, plus
    ``new_token_ratio`` × its remaining max_new_tokens for future decode steps."""
    future = int(new_token_ratio * req.remaining_new_tokens)
    return max(0, allocator.pages_for(req.seq_len + future) - len(req.pages))


class PrefillAdder:
    """Budgets of one prefill step: new tokens, running requests and KV pages.

    The KV check is SGLang's adaptive rule: free pages must cover every admitted request's
    uncomputed tokens plus a reserve of ``new_token_ratio`` × remaining max_new_tokens for each
    running and admitted request.
    """

    def __init__(self, *, allocator: PageAllocator, running: list[Req], max_running: int,
                 max_prefill_tokens: int, new_token_ratio: float):
        self.allocator = allocator
        self.ratio = new_token_ratio
        self.token_budget = max_prefill_tokens
        self.seat_budget = max_running - len(running)
        self.page_budget = allocator.num_free - sum(
            reserved_pages(r, allocator, new_token_ratio) for r in running
        )
        self.admitted: list[Req] = []

    def try_add(self, req: Req) -> bool:
        """Admit ``req`` if it fits every budget (a too-long prompt fits alone, first in line)."""
        new_tokens = req.seq_len - req.kv_len
        pages = reserved_pages(req, self.allocator, self.ratio)
        if self.seat_budget < 1 or pages > self.page_budget:
            return False
        if new_tokens > self.token_budget and self.admitted:
            return False
        self.admitted.append(req)
        self.seat_budget -= 1
        self.token_budget -= new_tokens
        self.page_budget -= pages
        return True
