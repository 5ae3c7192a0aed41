"""Scheduler: the waiting queue, the chunked request, the running batch, one decision per step.

Prefill first: if the chunked request (a prompt prefilled over several steps) or waiting
requests, in the schedule policy's order, can form a prefill batch within the budgets, run it
(with one decode token of every running request when mixing); otherwise decode every running
request by one token, retracting requests first if the pool cannot hold their next tokens.
A request is in exactly one of: waiting, chunked, running, finished (aborted included).

KV pages (:class:`RequestKV` keeps the books): on admission a request borrows the cached pages of
its longest cached prefix (locked) and gets private pages for the rest; the whole pages it
computes join the cache before the step runs, so requests admitted after it in the same step
borrow them (their writes come first in every layer). No page is written twice. At finish its
pages go to the cache (or are freed); the cache is evicted before an allocation fails.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from minijax_serve.core.request import FinishReason, Req
from minijax_serve.memory import PageAllocator, PrefixCache, RequestSlots, SlotTable
from minijax_serve.scheduler.batch import ScheduleBatch, SchedulerLimits
from minijax_serve.scheduler.invariants import check_ledgers
from minijax_serve.scheduler.policy import SchedulePolicy, match_waiting
from minijax_serve.scheduler.prefill_adder import PrefillAdder
from minijax_serve.scheduler.request_kv import RequestKV
from minijax_serve.scheduler.retract import NewTokenRatio, forced_retract_pick, retract_order


class Scheduler:
    """Owns the queues and the host ledgers (page allocator, request slots, prefix cache).
    Requests admitted in one step share their prefixes (:meth:`RequestKV.cache_ahead`): each
    shared whole page is computed once, with no request held back (one prompt's samples too)."""

    def __init__(self, *, allocator: PageAllocator, slots: RequestSlots, table: SlotTable,
                 cache: PrefixCache, policy: SchedulePolicy, limits: SchedulerLimits,
                 ratio: NewTokenRatio, eos_ids: tuple[int, ...]):
        self.allocator, self.slots, self.cache = allocator, slots, cache
        self.table = table  # mirrors the holders' ledgers per slot, for lowering
        self.eos_ids = frozenset(eos_ids)
        self.kv = RequestKV(allocator, slots, table, cache, self.eos_ids)
        self.policy, self.limits, self.ratio = policy, limits, ratio
        self.waiting: list[Req] = []  # arrival order, retracted requests in front
        self.chunked: Req | None = None  # mid-prefill: holds its slot and pages, not running yet
        self.running: list[Req] = []
        self.num_retracted = self.decode_ticks = 0
        # speculative decoding (set by the engine): each decoding request's drafts
        self.propose: Callable[[list[Req]], list[list[int]]] | None = None

    @property
    def cached_tokens(self) -> int:
        """Tokens admissions took from the prefix cache instead of computing."""
        return self.kv.cached_tokens

    @property
    def evicted_pages(self) -> int:
        return self.kv.evicted_pages

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def holders(self) -> list[Req]:
        """Requests holding a slot and KV pages: the running ones and the chunked one."""
        return self.running + [self.chunked] if self.chunked else self.running

    def schedule(self) -> ScheduleBatch | None:
        batch = self._schedule_prefill()
        if batch is None and self.running:
            batch = self._schedule_decode()
            if batch is None:  # a forced retract emptied the batch, or none may decode yet
                batch = self._schedule_prefill()
        return batch

    def _schedule_prefill(self) -> ScheduleBatch | None:
        if self.chunked is None and (not self.waiting or len(self.running) >= self.limits.max_running):
            return None
        chunk = self.limits.chunk_tokens
        mixed = self.limits.mixed and chunk is not None and bool(self.running)
        adder = PrefillAdder(allocator=self.allocator, cache=self.cache, holders=self.holders(),
                             table=self.table, max_running=self.limits.max_running,
                             max_prefill_tokens=self.limits.max_prefill_tokens,
                             chunk_tokens=chunk - len(self.running) if mixed else chunk,
                             new_token_ratio=self.ratio.value,
                             exact_ignore_eos=self.limits.exact_ignore_eos, chunked=self.chunked)
        reqs: list[Req] = []
        new_tokens: list[int] = []
        changed = False  # the cache changed in this step (pages joined it, or were evicted)
        if self.chunked is not None:
            n = adder.add_chunked(self.chunked)
            if n:
                reqs.append(self.chunked)
                new_tokens.append(n)
                self.kv.cache_ahead(self.chunked, n)
                changed = True
        admitted: list[Req] = []
        if self.waiting:
            ordered = self.policy.order(self.waiting)
            for req in ordered.reqs:
                if adder.seats_left < 1:
                    break
                if req.needs_prompt_logprobs:
                    match = self.cache.match_prefix(())
                    req.prompt_logprobs = []  # all of them again, from the first position
                else:
                    match = None if changed else ordered.matches.get(req.rid)
                    if match is None:
                        match = match_waiting(self.cache, req)
                self.cache.lock(match.node)
                n = adder.try_add(req, match.pages)
                if not n:
                    self.cache.unlock(match.node)
                    break
                new_pages = self.allocator.pages_for(req.seq_len) - len(match.pages)
                self.kv.make_free(new_pages)
                self.kv.admit(req, match, new_pages)
                self.kv.cache_ahead(req, n)
                adder.allocated(req, new_pages)
                changed = True
                admitted.append(req)
                new_tokens.append(n)
        if not new_tokens:
            return None
        if admitted:
            self.waiting = [r for r in self.waiting if r.slot is None]
        reqs += admitted
        for req, n in zip(reqs, new_tokens):
            if req.kv_len + n < req.seq_len:
                self.chunked = req
        num_prefill = len(reqs)
        if mixed:
            decodable = self._decodable()
            decoders = self._decoders(decodable, self.kv.missing_pages(decodable))
            reqs += decoders
            new_tokens += [1] * len(decoders)
        return ScheduleBatch.of(reqs, new_tokens, num_prefill, self.table, admitted)

    def _decodable(self) -> list[Req]:
        """The running requests that may decode: not those whose last token (by count) is still
        on its way to the host (with overlap), which finish when it arrives."""
        return [r for r in self.running if r.num_outputs < r.params.max_new_tokens]

    def _schedule_decode(self) -> ScheduleBatch | None:
        self.decode_ticks += 1
        every = self.limits.force_retract_every
        if every and self.decode_ticks % every == 0:
            victim = forced_retract_pick(self._decodable(), self.limits.retract_policy)
            if victim is not None:
                self.retract(victim)
        decodable = self._decodable()
        if not decodable:
            return None
        missing = self.kv.missing_pages(decodable)
        if self._decode_pages_short(missing) > 0:
            if len(decodable) < len(self.running):
                return None  # requests finishing in the step in flight free their pages first
            self._retract_until_decode_fits()
            decodable = self._decodable()
            missing = self.kv.missing_pages(decodable)
        else:
            self.ratio.on_decode_step()
        decoders = self._decoders(decodable, missing)
        drafts = self.kv.grow_drafts(decoders, self.propose(decoders)) if self.propose else None
        return ScheduleBatch.of(decoders, [1] * len(decoders), 0, self.table, drafts=drafts)

    def _decode_pages_short(self, missing: np.ndarray | None = None) -> int:
        """Pages the decodable requests' next tokens need beyond free and evictable ones."""
        return self.kv.pages_short(
            self.kv.missing_pages(self._decodable()) if missing is None else missing)

    def _retract_until_decode_fits(self) -> None:
        """Retract running requests, in the retract policy's order, until the others' next tokens
        fit; the chunked request goes last (alone, a request always fits: checked at submission)."""
        for req in retract_order(self._decodable(), self.limits.retract_policy)[:-1]:
            self.retract(req)
            if self._decode_pages_short() <= 0:
                break
        if self._decode_pages_short() > 0 and self.chunked is not None:
            self.retract(self.chunked)
        assert self._decode_pages_short() <= 0, "retract cannot make room for one request"
        self.ratio.on_retract(self.running)

    def retract(self, req: Req) -> None:
        """Send ``req`` back to the front of the waiting queue: it keeps its generated tokens and
        gives up its slot and pages (its computed tokens go to the prefix cache); re-admitted, it
        prefills its prompt and outputs again and goes on generating."""
        if req is self.chunked:
            self.chunked = None
        else:
            self.running.remove(req)
        self.kv.free(req)
        req.kv_len = 0
        req.epoch += 1
        req.num_retracted += 1
        req.outputs_at_retract = len(req.output_ids)
        self.num_retracted += 1
        self.waiting.insert(0, req)

    def _decoders(self, decodable: list[Req], missing: np.ndarray) -> list[Req]:
        """The decodable requests with the pages of their next token, longest first; none if
        those pages cannot be had without a retract."""
        return [] if self._decode_pages_short(missing) > 0 else self.kv.grow(decodable, missing)

    def launched(self, batch: ScheduleBatch) -> None:
        """Advance the ledgers as if ``batch`` (lowered, dispatched next) were done: its KV is
        written and each sampling request has one more (pending) output token. Prefilled
        tokens' whole pages that did not join the prefix cache before the step (the cache held
        them already: the request's duplicates are freed) join it now, and finished prefills
        join the running batch, so the next step can be scheduled before this one's tokens
        reach the host (later steps run after it on the device, so whatever they read of its
        pages is written by then)."""
        advance = batch.kv_advance
        self.table.launched(batch.slots, np.array(advance, np.int32), batch.samples)
        ps = self.allocator.page_size
        for i, (req, n, sampled) in enumerate(zip(batch.reqs, advance, batch.samples.tolist())):
            req.kv_len += n
            if sampled:
                req.num_pending += 1
                req.token_in_buffer = True
            if i < batch.num_prefill:
                if req.kv_len // ps * ps > req.prefix_len:  # else handed over before the step
                    self.kv.cache_prefill(req)
                if sampled:
                    if req is self.chunked:
                        self.chunked = None
                    self.running.append(req)

    def process(self, batch: ScheduleBatch, tokens, now: float,
                on_token: Callable[[Req], None] = lambda req: None) -> list[int]:
        """Take a launched step's tokens (an array, a token per row; a verify's: per row a run,
        its accepted drafts and the next token): append each request's (unless finished or
        retracted since), check stop conditions (a run's after each token, and ``on_token(req)``:
        stop strings), free what finished. Returns the rows that took any."""
        verify = batch.drafts is not None
        rows, values = [], (tokens if verify else tokens.tolist())
        for i, (req, sampled, epoch, run) in enumerate(zip(batch.reqs, batch.samples.tolist(),
                                                           batch.epochs, values)):
            if not sampled or req.epoch != epoch or req.finish_reason is not None:
                continue
            rows.append(i)
            req.num_pending -= 1
            if not verify:  # one token (``run``)
                req.append_token(run, now, self.eos_ids)
                continue
            for n, token in enumerate(run, 1):
                req.append_token(token, now, self.eos_ids)
                on_token(req)
                if req.finished:
                    break
            if batch.drafts[i]:
                self.kv.commit_drafts(req, n - 1)
        for i in rows:
            if batch.reqs[i].finish_reason is not None:
                self.release(batch.reqs[i], now)
        return rows

    def abort(self, req: Req, now: float) -> None:
        """Finish ``req`` with reason "abort" wherever it is (waiting, retracted, mid-prompt,
        running, with a token in flight): it is never scheduled again and its slot and pages go
        at once (its computed KV to the prefix cache, as for a finished request); a token of it
        still in flight is dropped when it arrives."""
        req.finish_reason = FinishReason.ABORT
        if req.slot is None:
            self.waiting.remove(req)
            req.finish_time = now
            if not self.has_unfinished():
                self.ratio.reset()
        else:
            self.release(req, now)

    def release(self, req: Req, now: float) -> None:
        """Hand a finished request's pages to the prefix cache and free its slot at once (it may
        have finished outside ``process``, e.g. on a stop string or an abort). The cache keeps
        the tokens whose KV is written: the prompt and every output token but the last."""
        if req.slot is None:
            return
        if req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        req.finish_time = now
        self.kv.free(req)
        if not self.has_unfinished():
            self.ratio.reset()

    def flush_cache(self) -> None:
        """Free every page of the prefix cache; refuses while requests are waiting or running."""
        if self.has_unfinished():
            raise RuntimeError(f"cannot flush the prefix cache while requests are in flight: "
                               f"{len(self.waiting)} waiting, {len(self.running)} running")
        self.cache.reset()

    def check_invariants(self) -> None:
        """Raise AssertionError if the ledgers disagree (:func:`check_ledgers`)."""
        check_ledgers(self.allocator, self.slots, self.table, self.cache, self.holders(),
                      self.waiting)
