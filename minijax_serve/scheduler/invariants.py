"""The scheduler's ledgers checked against each other (tests call it after every workload)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from minijax_serve.core.request import Req
from minijax_serve.memory import PageAllocator, PrefixCache, RequestSlots, SlotTable

if TYPE_CHECKING:
    from minijax_serve.scheduler.batch import ScheduleBatch


def check_ledgers(allocator: PageAllocator, slots: RequestSlots, table: SlotTable,
                  cache: PrefixCache, holders: list[Req], waiting: list[Req]) -> None:
    """Every page is in exactly one of: the free list, the prefix cache, a holder's (a running
    or the chunked request's) private pages; every slot is free or owned by a holder; the
    cache's locks are exactly those of the holders reading cached pages (so at idle nothing is
    locked); no waiting request holds anything."""
    ps = allocator.page_size
    if any(r.prefix_len % ps for r in holders):
        raise AssertionError("a request's cached prefix is not page-aligned")
    cache.check_invariants([(r.prefix_node, r.pages[:r.prefix_len // ps]) for r in holders])
    free_pages = allocator.free_page_ids()
    tree_pages = cache.page_ids()
    private = [p for r in holders for p in r.pages[r.prefix_len // ps:]]
    if len(private) != len(set(private)) or set(private) & (free_pages | tree_pages):
        raise AssertionError("a KV page is owned twice")
    if len(free_pages) + len(tree_pages) + len(private) != allocator.total_pages:
        raise AssertionError(
            f"KV pages leaked: {len(free_pages)} free + {len(tree_pages)} cached + "
            f"{len(private)} private != {allocator.total_pages}"
        )
    owned = [r.slot for r in holders]
    if None in owned or len(set(owned)) != len(owned) or slots.free_slot_ids() & set(owned):
        raise AssertionError("a request slot is missing or owned twice")
    for req in holders:
        table.check(req)
    if slots.num_free + len(owned) != slots.num_slots:
        raise AssertionError("request slots leaked")
    if any(r.slot is not None or r.pages or r.prefix_node is not None for r in waiting):
        raise AssertionError("a waiting request holds pages, a slot or a cache lock")


def check_step_writes(batch: ScheduleBatch, page_size: int) -> None:
    """Every KV page a step writes is written by one of its requests only: a page shared within
    the step is computed by one request and read, as its prefix, by the others."""
    written: set[int] = set()
    for req, start, n in zip(batch.reqs, batch.kv_starts.tolist(), batch.new_tokens):
        pages = set(req.pages[start // page_size:(start + n - 1) // page_size + 1])
        if written & pages:
            raise AssertionError(f"request {req.rid} writes pages {sorted(written & pages)} that "
                                 "another request of the same step writes")
        written |= pages
