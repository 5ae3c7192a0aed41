"""RadixCache.evict keeps its candidates as they appear (no walk of the tree per call): it frees
the same pages, in the same order, as the plain rule (every unlocked leaf, least recently used
first, a parent left childless joining in), on random scheduler-like operations."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest

from minijax_serve.memory import RadixCache
from minijax_serve.memory.page_allocator import PageAllocator


def plain_evict(cache: RadixCache, num_pages: int) -> list[int]:
    """The pages the plain rule would free, in order (on a walk of the tree; changes nothing)."""
    order = itertools.count()
    heap = [(n.last_access, next(order), n) for n in cache._nodes()
            if not n.children and n.lock_ref == 0]
    heapq.heapify(heap)
    children = {id(n): len(n.children) for n in cache._nodes()}
    freed: list[int] = []
    while len(freed) < num_pages and heap:
        _, _, leaf = heapq.heappop(heap)
        freed += leaf.pages
        parent = leaf.parent
        if parent is not cache._root:
            children[id(parent)] -= 1
            if not children[id(parent)] and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
    return freed


@pytest.mark.parametrize("page_size,seed", [(1, 0), (2, 1), (4, 2), (1, 3)])
def test_evict_frees_what_the_plain_rule_frees(page_size, seed):
    rng = np.random.default_rng(seed)
    alloc = PageAllocator(400, page_size)
    cache = RadixCache(alloc)
    running = []  # (tokens, locked node, pages)
    for _ in range(600):
        op = rng.random()
        if op < 0.45 and len(running) < 12:  # admit: match, lock, allocate the rest
            base = [int(x) for x in rng.integers(0, 3, size=int(rng.integers(1, 6)))]
            tokens = base * int(rng.integers(1, 4)) + [int(x) for x in rng.integers(0, 4, 3)]
            match = cache.match_prefix(tokens)
            cache.lock(match.node)
            need = -(-len(tokens) // page_size) - len(match.pages)
            if alloc.num_free < need:
                want = need - alloc.num_free
                expected = plain_evict(cache, want)
                before = alloc.free_page_ids()
                cache.evict(want)
                assert alloc.free_page_ids() - before == set(expected)
            if alloc.num_free < need:
                cache.unlock(match.node)
                continue
            running.append((tokens, match.node, match.pages + alloc.alloc(need)))
        elif op < 0.6:  # a waiting request matched (the cache-aware policies): used, not locked
            cache.match_prefix([int(x) for x in rng.integers(0, 3, size=int(rng.integers(1, 12)))])
        elif op < 0.85 and running:  # finish: hand every page to the cache
            tokens, node, pages = running.pop(int(rng.integers(len(running))))
            cache.cache_finished(tokens, pages)
            cache.unlock(node)
        else:  # evict some
            want = int(rng.integers(1, 20))
            expected = plain_evict(cache, want)
            before = alloc.free_page_ids()
            cache.evict(want)
            assert alloc.free_page_ids() - before == set(expected)
        cache.check_invariants()
