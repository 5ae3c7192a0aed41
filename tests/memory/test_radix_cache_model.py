"""RadixCache driven like a scheduler by a hypothesis state machine, against a reference model."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minijax_serve.memory import RadixCache
from minijax_serve.memory.page_allocator import PageAllocator

BASES = [[0] * 16, [0, 1, 2, 3] * 4, [0, 0, 1, 1] * 4]
# a cut of a shared base sequence and a random tail: prefixes collide and edges split often
token_lists = st.builds(
    lambda base, cut, tail: base[:cut] + tail,
    st.sampled_from(BASES),
    st.integers(0, 16),
    st.lists(st.integers(0, 3), max_size=4),
)


class RadixCacheMachine(RuleBasedStateMachine):
    """Drives a RadixCache like a scheduler would, against a reference model: the set of cached
    page-aligned prefixes (token tuple -> the page holding its last page of tokens)."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.P = page_size
        self.alloc = PageAllocator(48, page_size)
        self.cache = RadixCache(self.alloc)
        self.model: dict[tuple[int, ...], int] = {}
        self.running: list[tuple[list[int], object, list[int], int]] = []  # tokens, node, pages, borrowed

    def prefixes(self, tokens, n_pages):
        return [tuple(tokens[: (i + 1) * self.P]) for i in range(n_pages)]

    def expected_match(self, tokens):
        pages = []
        for prefix in self.prefixes(tokens, len(tokens) // self.P):
            if prefix not in self.model:
                break
            pages.append(self.model[prefix])
        return pages

    def locked_pages(self):
        return {p for _, _, pages, borrowed in self.running for p in pages[:borrowed]}

    def make_room(self, n, borrowed=()):
        if self.alloc.num_free < n:
            self.check_evict(n - self.alloc.num_free, set(borrowed))
        return self.alloc.num_free >= n

    def check_evict(self, num_pages, also_locked):
        locked = self.locked_pages() | also_locked
        before, free_before = self.cache.page_ids(), self.alloc.num_free
        freed = self.cache.evict(num_pages)
        gone = before - self.cache.page_ids()
        assert freed == len(gone) == self.alloc.num_free - free_before
        assert not gone & locked
        assert freed >= num_pages or self.cache.evictable_size == 0
        self.model = {k: p for k, p in self.model.items() if p not in gone}
        assert all(len(k) == self.P or k[: -self.P] in self.model for k in self.model)  # only leaves went

    @rule(tokens=token_lists)
    def start_request(self, tokens):
        m = self.cache.match_prefix(tokens)
        assert m.pages == self.expected_match(tokens) and m.length == len(m.pages) * self.P
        self.cache.lock(m.node)
        private = self.alloc.pages_for(len(tokens)) - len(m.pages)
        if not self.make_room(private, m.pages):
            self.cache.unlock(m.node)
            return
        self.running.append((tokens, m.node, m.pages + self.alloc.alloc(private), len(m.pages)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish_request(self, data):
        i = data.draw(st.integers(0, len(self.running) - 1))
        tokens, node, pages, _ = self.running.pop(i)
        self.cache.unlock(node)
        self.cache.cache_finished(tokens, pages)
        for prefix, page in zip(self.prefixes(tokens, len(tokens) // self.P), pages):
            self.model.setdefault(prefix, page)

    @rule(tokens=token_lists)
    def insert(self, tokens):
        n = len(tokens) // self.P
        if not self.make_room(n):
            return
        pages = self.alloc.alloc(n)
        cached = self.cache.insert(tokens, pages)
        assert cached == len(self.expected_match(tokens)) * self.P
        self.alloc.free(pages[: cached // self.P])  # all fresh, so all duplicates
        for prefix, page in zip(self.prefixes(tokens, n), pages):
            self.model.setdefault(prefix, page)

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages):
        self.check_evict(num_pages, set())

    @rule(rarely=st.integers(0, 3))
    def reset(self, rarely):
        if rarely:  # a flush wipes the state the other rules build up: keep it to a quarter
            return
        if self.cache.protected_size:
            with pytest.raises(RuntimeError):
                self.cache.reset()
            return
        self.cache.reset()
        self.model.clear()

    @invariant()
    def consistent(self):
        self.cache.check_invariants()
        assert self.cache.page_ids() == set(self.model.values())
        assert self.cache.evictable_size + self.cache.protected_size == self.P * len(self.model)
        locked_prefixes = {
            prefix for tokens, _, _, borrowed in self.running for prefix in self.prefixes(tokens, borrowed)
        }
        assert self.cache.protected_size == self.P * len(locked_prefixes)
        private = sum(len(pages) - borrowed for _, _, pages, borrowed in self.running)
        assert self.alloc.num_free + self.cache.total_pages + private == self.alloc.total_pages


RadixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, database=None  # about 3 s
)
test_radix_cache_against_model = RadixCacheMachine.TestCase
