"""Scheduler: the waiting queue, the running batch, and one decision per step.

Prefill first: if waiting requests, in the schedule policy's order, can form a prefill batch
within the budgets, run it; otherwise decode every running request by one token.

KV pages and the prefix cache: on admission a request borrows the cached pages of its longest
cached prefix (locking them) and gets private pages for the rest, so its prefill computes only
the uncached suffix and never writes a page the cache owns. Right after its prefill its prompt's
whole pages join the cache, so later requests share them while it still runs; when it finishes
all its pages go to the cache (or are freed). When free pages run short, the cache is evicted
before an allocation fails. Request slots are taken on admission and freed at finish.
"""

from __future__ import annotations

from typing import NamedTuple

from minijax_serve.memory import PageAllocator, PrefixCache, PrefixMatch, RequestSlots
from minijax_serve.request import FinishReason, Req
from minijax_serve.scheduler.policy import SchedulePolicy, match_waiting, shares_uncached_prefix
from minijax_serve.scheduler.prefill_adder import PrefillAdder

# Reserve each admitted request's whole max_new_tokens: no over-commit, so decode never runs out.
NEW_TOKEN_RATIO = 1.0


class ScheduleBatch(NamedTuple):
    reqs: list[Req]
    new_tokens: list[int]  # tokens each request computes in this step
    is_prefill: bool


class Scheduler:
    """Owns the queues and the host ledgers: page allocator, request slots, prefix cache.

    ``in_batch_prefix_threshold``: a waiting request that shares at least that many uncached
    tokens (and one whole page) with a request admitted in the same step waits a step and then
    reuses its cached prompt; 0 turns this in-batch dedup off.
    """

    def __init__(self, *, allocator: PageAllocator, slots: RequestSlots, cache: PrefixCache,
                 policy: SchedulePolicy, max_running: int, max_prefill_tokens: int,
                 in_batch_prefix_threshold: int, eos_ids: tuple[int, ...]):
        self.allocator = allocator
        self.slots = slots
        self.cache = cache
        self.policy = policy
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        threshold = in_batch_prefix_threshold
        self.dedup_min_shared = max(threshold, allocator.page_size) if threshold else 0
        self.eos_ids = frozenset(eos_ids)
        self.waiting: list[Req] = []  # arrival order
        self.running: list[Req] = []
        self.new_token_ratio = NEW_TOKEN_RATIO
        self.evicted_pages = 0

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduleBatch | None:
        batch = self._schedule_prefill()
        if batch is None and self.running:
            batch = self._schedule_decode()
        return batch

    def _schedule_prefill(self) -> ScheduleBatch | None:
        if not self.waiting or len(self.running) >= self.max_running:
            return None
        ordered = self.policy.order(self.waiting)
        adder = PrefillAdder(allocator=self.allocator, cache=self.cache, running=self.running,
                             max_running=self.max_running,
                             max_prefill_tokens=self.max_prefill_tokens,
                             new_token_ratio=self.new_token_ratio)
        admitted: list[tuple[Req, PrefixMatch]] = []
        admitted_tokens: list[list[int]] = []
        for req in ordered.reqs:
            if adder.seats_left < 1:
                break
            match = ordered.matches.get(req.rid)
            if match is None:
                match = match_waiting(self.cache, req)
            tokens = req.token_ids(0, req.seq_len)
            if shares_uncached_prefix(tokens, match.length, admitted_tokens, self.dedup_min_shared):
                continue
            self.cache.lock(match.node)
            if not adder.try_add(req, match.length):
                self.cache.unlock(match.node)
                break
            admitted.append((req, match))
            admitted_tokens.append(tokens)
        if not admitted:
            return None
        new_pages = [self.allocator.pages_for(r.seq_len) - len(m.pages) for r, m in admitted]
        self._make_free(sum(new_pages))
        for (req, match), n in zip(admitted, new_pages):
            self._admit(req, match, n)
        self.waiting = [r for r in self.waiting if r.slot is None]
        reqs = [r for r, _ in admitted]
        return ScheduleBatch(reqs, [r.seq_len - r.kv_len for r in reqs], is_prefill=True)

    def _admit(self, req: Req, match: PrefixMatch, new_pages: int) -> None:
        """Give an admitted request its slot, the cached prefix (locked by the caller) and
        ``new_pages`` private pages; its prefill starts after the prefix."""
        assert match.length == len(match.pages) * self.allocator.page_size, "prefix not page-aligned"
        req.slot = self.slots.alloc()
        req.pages = match.pages + self.allocator.alloc(new_pages)
        req.prefix_node, req.prefix_len = match.node, match.length
        req.kv_len = req.cached_tokens = match.length  # writes start on the first private page

    def _schedule_decode(self) -> ScheduleBatch:
        missing = [self.allocator.pages_for(r.seq_len) - len(r.pages) for r in self.running]
        self._make_free(sum(m for m in missing if m > 0))
        for req, n in zip(self.running, missing):
            if n > 0:
                req.pages += self.allocator.alloc(n)
        # longest first: the attention walks each chunk of sequences to its longest prefix
        reqs = sorted(self.running, key=lambda r: r.seq_len, reverse=True)
        return ScheduleBatch(reqs, [1] * len(reqs), is_prefill=False)

    def _make_free(self, num_pages: int) -> None:
        """Evict prefix-cache pages until ``num_pages`` pages are free (the budgets guarantee
        that enough of them are evictable)."""
        short = num_pages - self.allocator.num_free
        if short > 0:
            self.evicted_pages += self.cache.evict(short)

    def process(self, batch: ScheduleBatch, tokens, now: float) -> None:
        """Append each request's sampled token, check its stop conditions, share the prompts
        just prefilled through the prefix cache, free what finished."""
        for req, n, token in zip(batch.reqs, batch.new_tokens, tokens):
            req.kv_len += n
            req.output_ids.append(int(token))
            req.token_in_buffer = True
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            self._check_stop(req, int(token))
        if batch.is_prefill:
            unfinished = [r for r in batch.reqs if not r.finished]
            for req in unfinished:
                self._cache_prefill(req)
            self.running += unfinished
        for req in batch.reqs:
            if req.finished:
                self.release(req, now)

    def _cache_prefill(self, req: Req) -> None:
        """Hand the whole pages of a running request's computed tokens to the prefix cache; the
        request borrows them from now on (its next writes are past them)."""
        match = self.cache.cache_unfinished(req.token_ids(0, req.kv_len), req.pages)
        self.cache.lock(match.node)
        self.cache.unlock(req.prefix_node)
        req.pages[:len(match.pages)] = match.pages
        req.prefix_node, req.prefix_len = match.node, match.length
        assert req.prefix_len <= req.kv_len

    def _check_stop(self, req: Req, token: int) -> None:
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens and (
            (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        ):
            req.finish_reason = FinishReason.STOP
        elif len(req.output_ids) >= p.max_new_tokens:
            req.finish_reason = FinishReason.LENGTH

    def release(self, req: Req, now: float) -> None:
        """Hand a finished request's pages to the prefix cache and free its slot at once (it may
        have finished outside ``process``, e.g. on a stop string). The cache keeps the tokens
        whose KV is written: the prompt and every output token but the last."""
        if req.slot is None:
            return
        if req in self.running:
            self.running.remove(req)
        req.finish_time = now
        self.cache.unlock(req.prefix_node)
        self.cache.cache_finished(req.token_ids(0, req.kv_len), req.pages)
        self.slots.free(req.slot)
        req.pages, req.slot, req.token_in_buffer = [], None, False
        req.prefix_node, req.prefix_len = None, 0

    def flush_cache(self) -> None:
        """Free every page of the prefix cache; refuses while requests are waiting or running."""
        if self.has_unfinished():
            raise RuntimeError(
                f"cannot flush the prefix cache while requests are in flight: "
                f"{len(self.waiting)} waiting, {len(self.running)} running"
            )
        self.cache.reset()

    def check_invariants(self) -> None:
        """Every page is in exactly one of: the free list, the prefix cache, a running request's
        private pages; every slot is free or owned by one running request; at idle nothing is
        locked in the cache."""
        self.cache.check_invariants()
        ps = self.allocator.page_size
        free_pages = self.allocator.free_page_ids()
        tree_pages = self.cache.page_ids()
        private = [p for r in self.running for p in r.pages[r.prefix_len // ps:]]
        borrowed = {p for r in self.running for p in r.pages[:r.prefix_len // ps]}
        if len(private) != len(set(private)) or set(private) & (free_pages | tree_pages):
            raise AssertionError("a KV page is owned twice")
        if not borrowed <= tree_pages:
            raise AssertionError("a request reads cached pages the prefix cache no longer holds")
        if len(free_pages) + len(tree_pages) + len(private) != self.allocator.total_pages:
            raise AssertionError(
                f"KV pages leaked: {len(free_pages)} free + {len(tree_pages)} cached + "
                f"{len(private)} private != {self.allocator.total_pages}"
            )
        slots = [r.slot for r in self.running]
        if None in slots or len(set(slots)) != len(slots) or self.slots.free_slot_ids() & set(slots):
            raise AssertionError("a request slot is missing or owned twice")
        if self.slots.num_free + len(slots) != self.slots.num_slots:
            raise AssertionError("request slots leaked")
        if any(r.slot is not None or r.pages or r.prefix_node is not None for r in self.waiting):
            raise AssertionError("a waiting request holds pages, a slot or a cache lock")
        if not self.has_unfinished() and self.cache.protected_size:
            raise AssertionError(f"{self.cache.protected_size} cached tokens are locked at idle")
