"""RadixCache and NoPrefixCache: unit tests (the stateful property test against a reference
model: test_radix_cache_model.py)."""

from __future__ import annotations

import pytest

from minijax_serve.memory import NoPrefixCache, RadixCache
from minijax_serve.memory.page_allocator import PageAllocator


def make(page_size: int, num_pages: int = 64) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages, page_size)
    return alloc, RadixCache(alloc)


def cache_new(cache: RadixCache, tokens: list[int]) -> list[int]:
    """Cache `tokens` (whole pages) in fresh pages, as a request with no match would; returns them."""
    pages = cache.allocator.alloc(len(tokens) // cache.page_size)
    cache.cache_finished(tokens, pages)
    return pages


@pytest.mark.parametrize("P", [1, 4])
def test_match_on_empty_tree(P):
    _, cache = make(P)
    m = cache.match_prefix([1, 2, 3, 4, 5])
    assert (m.length, m.pages) == (0, [])
    cache.lock(m.node)  # the root: a no-op
    assert cache.protected_size == 0


@pytest.mark.parametrize("P", [1, 4])
def test_insert_then_match(P):
    _, cache = make(P)
    tokens = list(range(3 * P))
    pages = cache_new(cache, tokens)
    assert cache.match_prefix(tokens).pages == pages
    assert cache.match_prefix(tokens + [99]).length == 3 * P
    assert cache.match_prefix([7] + tokens).length == 0
    assert cache.evictable_size == 3 * P and cache.total_pages == 3
    cache.check_invariants()


def test_match_counts_whole_pages_only():
    _, cache = make(4)
    pages = cache_new(cache, list(range(8)))
    m = cache.match_prefix(list(range(7)))
    assert (m.length, m.pages) == (4, pages[:1])
    # a mismatch inside a page loses the whole page
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99]).length == 4


def test_match_splits_edge_at_page_boundary():
    _, cache = make(2)
    pages = cache_new(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    m = cache.match_prefix([1, 2, 3, 4, 5, 9])  # 5 matches, but its page [5, 9] does not
    assert (m.length, m.pages) == (4, pages[:2])
    assert m.node.key == (1, 2, 3, 4) and m.node.pages == pages[:2]
    (lower,) = m.node.children.values()
    assert lower.key == (5, 6, 7, 8) and lower.pages == pages[2:]
    assert cache.evictable_size == 8
    cache.check_invariants()


@pytest.mark.parametrize("P", [1, 4])
def test_insert_returns_cached_prefix_and_leaves_duplicates_to_caller(P):
    alloc, cache = make(P)
    first = alloc.alloc(3)
    assert cache.insert(list(range(3 * P)), first) == 0
    second = alloc.alloc(4)
    tokens = list(range(2 * P)) + [50] * (2 * P) + [7] * (P - 1)  # partial last page ignored
    assert cache.insert(tokens, second) == 2 * P
    # the tree took second[2:] and none of second[:2]: those are the caller's duplicates to free
    assert cache.page_ids() == set(first) | set(second[2:])
    alloc.free(second[:2])
    assert alloc.num_free + cache.total_pages == alloc.total_pages
    cache.check_invariants()


def test_insert_validates_page_count():
    alloc, cache = make(4)
    with pytest.raises(ValueError):
        cache.insert(list(range(8)), alloc.alloc(1))
    with pytest.raises(ValueError):
        cache.insert(list(range(9)), alloc.alloc(3))


def test_cache_finished_frees_duplicates_and_tail_keeps_borrowed():
    alloc, cache = make(4)
    cached = cache_new(cache, list(range(8)))
    # request A borrows the first cached page, computes the rest privately, ends in a partial page
    tokens = list(range(8)) + [9, 9, 9, 9, 5]
    m = cache.match_prefix(tokens)
    assert m.pages == cached
    cache.lock(m.node)
    private = alloc.alloc(3)  # tokens 8..11 and the tail token 12
    cache.unlock(m.node)
    free_before = alloc.num_free
    cache.cache_finished(tokens, m.pages + private)
    assert cache.page_ids() == set(cached) | {private[0]}
    assert alloc.num_free == free_before + 2  # private[1] (spare) and private[2] (tail) freed

    # request B computed cached tokens privately: all its pages are duplicates or tail
    dup = alloc.alloc(4)
    cache.cache_finished(tokens[:13], dup[:4])
    assert cache.page_ids() == set(cached) | {private[0]}
    assert alloc.num_free + cache.total_pages == alloc.total_pages
    with pytest.raises(ValueError):
        cache.cache_finished(list(range(5)), alloc.alloc(1))
    cache.check_invariants()


def test_lock_protects_path_and_counts():
    _, cache = make(1)
    cache_new(cache, [1, 2, 3])
    cache_new(cache, [1, 2, 4, 5])
    m = cache.match_prefix([1, 2, 4, 5])
    cache.lock(m.node)
    cache.lock(m.node)
    assert (cache.protected_size, cache.evictable_size) == (4, 1)
    cache.unlock(m.node)
    assert (cache.protected_size, cache.evictable_size) == (4, 1)
    cache.unlock(m.node)
    assert (cache.protected_size, cache.evictable_size) == (0, 5)
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)
    cache.check_invariants()


def test_split_keeps_locks():
    _, cache = make(2)
    cache_new(cache, [1, 1, 2, 2, 3, 3])
    m = cache.match_prefix([1, 1, 2, 2, 3, 3])
    cache.lock(m.node)
    cache_new(cache, [1, 1, 8, 8])  # splits the locked edge after its first page
    assert (cache.protected_size, cache.evictable_size) == (6, 2)
    cache.check_invariants([(m.node, m.pages)])  # the lock still reads through both halves
    cache.unlock(m.node)
    assert (cache.protected_size, cache.evictable_size) == (0, 8)
    cache.check_invariants([])


def test_check_invariants_matches_locks_to_borrowers():
    alloc, cache = make(2)
    cache_new(cache, [1, 1, 2, 2, 3, 3])
    cache_new(cache, [1, 1, 2, 2, 4, 4])
    a, b = cache.match_prefix([1, 1, 2, 2, 3, 3]), cache.match_prefix([1, 1, 2, 2])
    cache.lock(a.node)
    cache.lock(b.node)
    cache.check_invariants([(a.node, a.pages), (b.node, b.pages)])
    cache.check_invariants()  # without borrowers the locks are not matched
    with pytest.raises(AssertionError, match="lock_ref 2, but 1"):
        cache.check_invariants([(a.node, a.pages)])  # a lock nobody holds
    with pytest.raises(AssertionError, match="lock_ref 2, but 3"):
        cache.check_invariants([(a.node, a.pages)] * 2 + [(b.node, b.pages)])  # a missing lock
    with pytest.raises(AssertionError, match="path"):
        cache.check_invariants([(a.node, a.pages[:2]), (b.node, b.pages)])
    with pytest.raises(AssertionError, match="no node"):
        cache.check_invariants([(None, []), (a.node, a.pages), (b.node, b.pages)])
    cache.unlock(a.node)
    cache.unlock(b.node)
    cache.evict(100)
    with pytest.raises(AssertionError, match="left the tree"):
        cache.check_invariants([(a.node, a.pages)])
    none = NoPrefixCache(alloc)
    root = none.match_prefix([1, 1, 2, 2]).node
    none.check_invariants([(root, [])])
    with pytest.raises(AssertionError, match="without a prefix cache"):
        none.check_invariants([(a.node, [])])


def test_evict_lru_order_and_parents_follow():
    alloc, cache = make(1)
    a = cache_new(cache, [0, 1, 2])
    cache_new(cache, [0, 1, 3])  # leaf [3], older than c
    c = cache_new(cache, [5])
    cache.match_prefix([0, 1, 2])  # a's leaf [2] is now the most recent
    assert cache.evict(1) == 1 and cache.page_ids() == set(a) | set(c)  # leaf [3] went
    assert cache.evict(1) == 1 and cache.page_ids() == set(a)  # c went
    # a's leaf [2] goes, then its parent [0, 1] is a childless leaf and goes too
    assert cache.evict(2) == 3 and cache.page_ids() == set()
    assert cache.evict(5) == 0
    assert alloc.num_free == alloc.total_pages
    cache.check_invariants()


@pytest.mark.parametrize("P", [1, 4])
def test_evict_never_frees_locked_pages(P):
    alloc, cache = make(P)
    kept = cache_new(cache, list(range(2 * P)))
    cache_new(cache, [9] * (3 * P))
    cache_new(cache, list(range(P)) + [7] * P)  # shares kept's first page
    m = cache.match_prefix(list(range(2 * P)))
    cache.lock(m.node)
    assert cache.evict(100) == 4
    assert cache.page_ids() == set(kept)
    assert (cache.evictable_size, cache.protected_size) == (0, 2 * P)
    cache.unlock(m.node)
    assert cache.evict(100) == 2 and alloc.num_free == alloc.total_pages
    cache.check_invariants()


def test_reset_refuses_while_locked_then_frees_everything():
    alloc, cache = make(2)
    cache_new(cache, [1, 2, 3, 4])
    cache_new(cache, [1, 2, 5, 6])
    m = cache.match_prefix([1, 2, 3, 4])
    cache.lock(m.node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    cache.unlock(m.node)
    cache.reset()
    assert alloc.num_free == alloc.total_pages
    assert (cache.total_pages, cache.evictable_size, cache.match_prefix([1, 2]).length) == (0, 0, 0)
    cache.check_invariants()


def test_check_invariants_catches_a_broken_counter():
    _, cache = make(1)
    cache_new(cache, [1, 2])
    cache._evictable += 1
    with pytest.raises(AssertionError, match="sizes"):
        cache.check_invariants()


def test_no_prefix_cache_frees_everything():
    alloc = PageAllocator(16, 4)
    cache = NoPrefixCache(alloc)
    m = cache.match_prefix(list(range(12)))
    assert (m.length, m.pages) == (0, [])
    cache.lock(m.node)
    cache.unlock(m.node)
    cache.cache_finished(list(range(10)), alloc.alloc(3))
    assert alloc.num_free == alloc.total_pages
    assert (cache.evictable_size, cache.protected_size, cache.total_pages, cache.evict(4)) == (0, 0, 0, 0)
    assert cache.page_ids() == set()
    cache.reset()
    cache.check_invariants()
