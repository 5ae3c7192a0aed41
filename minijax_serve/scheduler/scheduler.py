"""Scheduler: the waiting queue, the running batch, and one decision per step.

Prefill first: if waiting requests can form a prefill batch within the budgets, run it;
otherwise decode every running request by one token. Pages and request slots are allocated on
admission (never for waiting requests) and freed as soon as a request finishes.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

from minijax_serve.memory import PageAllocator, RequestSlots
from minijax_serve.request import FinishReason, Req
from minijax_serve.scheduler.prefill_adder import PrefillAdder

# Reserve each admitted request's whole max_new_tokens: no over-commit, so decode never runs out.
NEW_TOKEN_RATIO = 1.0


class ScheduleBatch(NamedTuple):
    reqs: list[Req]
    new_tokens: list[int]  # tokens each request computes in this step
    is_prefill: bool


class Scheduler:
    def __init__(self, *, allocator: PageAllocator, slots: RequestSlots, max_running: int,
                 max_prefill_tokens: int, eos_ids: tuple[int, ...]):
        self.allocator = allocator
        self.slots = slots
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_ids = frozenset(eos_ids)
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []
        self.new_token_ratio = NEW_TOKEN_RATIO

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
        if not self.waiting:
            return None
        adder = PrefillAdder(allocator=self.allocator, running=self.running,
                             max_running=self.max_running,
                             max_prefill_tokens=self.max_prefill_tokens,
                             new_token_ratio=self.new_token_ratio)
        while self.waiting and adder.try_add(self.waiting[0]):
            self.waiting.popleft()
        if not adder.admitted:
            return None
        for req in adder.admitted:
            req.slot = self.slots.alloc()
            req.pages = self.allocator.alloc(self.allocator.pages_for(req.seq_len))
        new_tokens = [r.seq_len - r.kv_len for r in adder.admitted]
        return ScheduleBatch(adder.admitted, new_tokens, is_prefill=True)

    def _schedule_decode(self) -> ScheduleBatch:
        for req in self.running:
            missing = self.allocator.pages_for(req.seq_len) - len(req.pages)
            if missing > 0:
                req.pages += self.allocator.alloc(missing)
        # longest first: the attention walks each chunk of sequences to its longest prefix
        reqs = sorted(self.running, key=lambda r: r.seq_len, reverse=True)
        return ScheduleBatch(reqs, [1] * len(reqs), is_prefill=False)

    def process(self, batch: ScheduleBatch, tokens, now: float) -> None:
        """Append each request's sampled token, check its stop conditions, free what finished."""
        for req, n, token in zip(batch.reqs, batch.new_tokens, tokens):
            req.kv_len += n
            req.output_ids.append(int(token))
            req.token_in_buffer = True
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            self._check_stop(req, int(token))
        if batch.is_prefill:
            self.running += [r for r in batch.reqs if not r.finished]
        for req in batch.reqs:
            if req.finished:
                self.release(req, now)

    def _check_stop(self, req: Req, token: int) -> None:
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens and (
            (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        ):
            req.finish_reason = FinishReason.STOP
        elif len(req.output_ids) >= p.max_new_tokens:
            req.finish_reason = FinishReason.LENGTH

    def release(self, req: Req, now: float) -> None:
        """Free a finished request's pages and slot at once (it may have finished outside
        ``process``, e.g. on a stop string)."""
        if req.slot is None:
            return
        if req in self.running:
            self.running.remove(req)
        req.finish_time = now
        self.allocator.free(req.pages)
        self.slots.free(req.slot)
        req.pages, req.slot, req.token_in_buffer = [], None, False

    def check_invariants(self) -> None:
        """Every page and slot is either free or owned by exactly one running request."""
        owned_pages = [p for r in self.running for p in r.pages]
        free_pages = self.allocator.free_page_ids()
        if len(owned_pages) != len(set(owned_pages)) or free_pages & set(owned_pages):
            raise AssertionError("a KV page is owned twice")
        if len(free_pages) + len(owned_pages) != self.allocator.total_pages:
            raise AssertionError(
                f"KV pages leaked: {len(free_pages)} free + {len(owned_pages)} owned "
                f"!= {self.allocator.total_pages}"
            )
        slots = [r.slot for r in self.running]
        if None in slots or len(set(slots)) != len(slots) or self.slots.free_slot_ids() & set(slots):
            raise AssertionError("a request slot is missing or owned twice")
        if self.slots.num_free + len(slots) != self.slots.num_slots:
            raise AssertionError("request slots leaked")
        if any(r.slot is not None or r.pages for r in self.waiting):
            raise AssertionError("a waiting request holds pages or a slot")
