"""Radix prefix cache: KV pages of finished requests, keyed by the tokens whose KV they hold.

A radix tree whose edges are labelled with token ids and whose nodes hold the KV page ids of those
tokens, one page per `page_size` tokens. Only whole pages are cached: every edge label is a
multiple of the page size long and edges split only at page boundaries, so a request that matches
a prefix reads those pages as they are and writes its own tokens into pages of its own.

Ownership contract (what the scheduler relies on):
- `match_prefix(tokens)` lends the tree's pages of the longest cached prefix. They stay the tree's:
  `lock(match.node)` while a request reads them (a locked path is never evicted) and
  `unlock(match.node)` once it no longer does. The request allocates its own pages for the rest.
- `cache_finished(tokens, pages)` takes ALL the pages a finished request holds, borrowed ones
  included; afterwards the request owns no page. Borrowed pages stay the tree's; private whole
  pages join the tree, or are freed when their tokens were cached meanwhile (duplicates); pages
  past the last whole page of `tokens` (the partial tail page) are freed.
- `cache_unfinished(tokens, pages)` shares a running request's computed prefix at once (after its
  prefill): its whole pages join the tree (duplicates are freed) and the returned match says which
  pages the request now borrows and which node it must lock in place of its old one. The pages
  past the last whole page stay the request's.
- `insert(tokens, pages)` is the lower-level tree operation behind it (see its docstring).
- `evict(n)` frees unlocked pages, least recently used leaves first; `reset()` frees every page
  and refuses while anything is locked.

`NoPrefixCache` (`prefix_cache.py`, with the interface) has the same calls for
`enable_radix_cache=False`: nothing is ever cached and `cache_finished` frees every page, so the
scheduler has one code path.

Sizes are in tokens, kept incrementally: `evictable_size` counts the tokens of unlocked nodes (all
freeable by `evict`, leaves first), `protected_size` those of locked nodes; their sum is
`page_size * total_pages`.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from typing import Iterator, Sequence

from minijax_serve.memory.page_allocator import SCRATCH_PAGE, PageAllocator
from minijax_serve.memory.prefix_cache import Borrowers, PrefixMatch, TreeNode, check_pages_cover


class RadixCache:
    """Page-aligned radix tree of cached KV pages with lock counts and LRU eviction."""

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._root = TreeNode((), [], None, 0)
        self._clock = 0  # logical time: one tick per match/insert, so LRU order has no ties
        self._evictable = 0
        self._protected = 0
        # evict()'s candidates (last access when pushed, tie, node), checked as they come up
        # (a node used, locked, given a child or evicted since is stale): no walk of the tree
        self._leaves: list[tuple[int, int, TreeNode]] = []
        self._order, self._num_nodes = itertools.count(), 0

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._leaves, (node.last_access, next(self._order), node))

    @property
    def evictable_size(self) -> int:
        """Tokens in unlocked nodes."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected

    @property
    def total_pages(self) -> int:
        """Pages the tree holds."""
        return (self._evictable + self._protected) // self.page_size

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of the whole pages of `tokens`.

        An edge matched part-way is split so that `node` ends exactly at the match; the path is
        marked as just used. The pages are lent, not given: lock `node` before relying on them.
        """
        node, pages = self._descend(tokens, len(tokens) - len(tokens) % self.page_size)
        return PrefixMatch(len(pages) * self.page_size, pages, node)

    def insert(self, tokens: Sequence[int], pages: Sequence[int]) -> int:
        """Cache the whole pages of `tokens` (a partial last page is ignored) and return how many
        of those tokens were already cached.

        `pages` holds exactly one page per whole page of tokens: len(tokens) // page_size of them.
        With k the returned length, the tree takes `pages[k // page_size:]`; it takes none of
        `pages[:k // page_size]`: those that are the tree's own page at that position (borrowed
        through match_prefix) stay the tree's, every other one is a duplicate the caller must free.
        """
        return self._insert(tokens, pages)[0]

    def cache_finished(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Take every page of a finished request: `pages` in order, covering `tokens` (the tokens
        whose KV they hold). Whole pages are cached or, if duplicates, freed; the rest is freed."""
        check_pages_cover(self.allocator, tokens, pages)
        match = self._cache_whole_pages(tokens, pages)
        self.allocator.free(list(pages[len(match.pages):]))

    def cache_unfinished(self, tokens: Sequence[int], pages: Sequence[int]) -> PrefixMatch:
        """Cache the whole pages of a running request's computed `tokens` (`pages` covers them,
        in order); the request's duplicates among them are freed.

        Returns the match of those whole pages: `pages` are the tree's pages that the request now
        uses in place of its first ones, `node` the node it locks in place of its old one (lock
        the new node before unlocking the old). The request keeps its pages past them."""
        check_pages_cover(self.allocator, tokens, pages)
        return self._cache_whole_pages(tokens, pages)

    def _cache_whole_pages(self, tokens: Sequence[int], pages: Sequence[int]) -> PrefixMatch:
        """Insert the whole pages of `tokens`, free the caller's duplicates, return their match."""
        n = len(tokens) // self.page_size
        _, duplicates, match = self._insert(tokens[: n * self.page_size], pages[:n])
        self.allocator.free(duplicates)
        return match

    def lock(self, node: TreeNode) -> None:
        """Protect the path from `node` up to the root from eviction (counted: lock per user)."""
        while node is not self._root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`."""
        while node is not self._root:
            if node.lock_ref == 0:
                raise RuntimeError("unlock of a radix cache node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
                if not node.children:
                    self._push(node)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free unlocked leaves, least recently used first (a parent left childless and unlocked
        becomes a leaf in turn), until `num_pages` pages are freed or none is evictable.
        Returns the number of pages freed."""
        if len(self._leaves) > 2 * self._num_nodes + 64:  # mostly stale entries: start over
            self._leaves = [(n.last_access, next(self._order), n) for n in self._nodes()
                            if not n.children and n.lock_ref == 0]
            heapq.heapify(self._leaves)
        freed = 0
        while freed < num_pages and self._leaves:
            used, _, leaf = heapq.heappop(self._leaves)
            parent = leaf.parent
            if parent is None or leaf.children or leaf.lock_ref:
                continue  # evicted already; a leaf no more; locked (pushed again when unlocked)
            if used != leaf.last_access:  # used since: its place is later
                self._push(leaf)
                continue
            del parent.children[leaf.key[: self.page_size]]
            leaf.parent, self._num_nodes = None, self._num_nodes - 1
            self._evictable -= len(leaf.key)
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            if parent is not self._root and not parent.children and parent.lock_ref == 0:
                self._push(parent)
        return freed

    def reset(self) -> None:
        """Free every cached page (flush). Refuses while a running request holds a lock."""
        if self._protected:
            raise RuntimeError(f"cannot reset the prefix cache: {self._protected} cached tokens are locked")
        self.allocator.free([p for node in self._nodes() for p in node.pages])
        self._root.children.clear()  # the root object stays: empty matches handed out still point at it
        self._evictable, self._num_nodes = 0, 0
        self._leaves.clear()

    def page_ids(self) -> set[int]:
        return {p for node in self._nodes() for p in node.pages}  # every page (walks the tree)

    def check_invariants(self, borrowers: Borrowers | None = None) -> None:
        """Walk the tree and check its shape, the size counters and page ownership.

        ``borrowers``: every lock holder, as (the node it locked, the cached pages it reads). When
        given, each node must still be in the tree with exactly those pages on its path from the
        root, and each node's lock count must be the number of borrowers at or below it.
        """
        P = self.page_size
        root = self._root
        if root.key or root.pages or root.lock_ref:
            raise AssertionError("the radix cache root holds tokens, pages or a lock")
        evictable = protected = 0
        pages: list[int] = []
        for node in self._nodes():
            where = f"radix cache node {node.key[:P]}..."
            if not node.key or len(node.key) % P or len(node.pages) != len(node.key) // P:
                raise AssertionError(f"{where}: {len(node.key)} tokens in {len(node.pages)} pages of {P}")
            if node.parent.children.get(node.key[:P]) is not node:
                raise AssertionError(f"{where}: not its parent's child under its first page")
            if node.lock_ref < 0 or (node.parent is not root and node.parent.lock_ref < node.lock_ref):
                raise AssertionError(f"{where}: lock_ref {node.lock_ref}, parent's {node.parent.lock_ref}")
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
            pages.extend(node.pages)
        if (evictable, protected) != (self._evictable, self._protected):
            raise AssertionError(
                f"radix cache sizes: counted evictable {evictable}, protected {protected}; "
                f"kept {self._evictable}, {self._protected}"
            )
        held = set(pages)
        if len(held) != len(pages):
            raise AssertionError("a page appears twice in the radix cache")
        wrong = held & (self.allocator.free_page_ids() | {SCRATCH_PAGE})
        if wrong:
            raise AssertionError(f"the radix cache holds free or scratch pages {sorted(wrong)}")
        if borrowers is not None:
            self._check_borrowers(borrowers)

    def _check_borrowers(self, borrowers: Borrowers) -> None:
        P = self.page_size
        locks: collections.Counter[TreeNode] = collections.Counter()
        for node, pages in borrowers:
            if node is None:
                raise AssertionError("a request reading the prefix cache holds no node of it")
            path: list[list[int]] = []
            while node is not self._root:
                if node.parent is None or node.parent.children.get(node.key[:P]) is not node:
                    raise AssertionError("a request locks a radix cache node that left the tree")
                locks[node] += 1
                path.append(node.pages)
                node = node.parent
            if [p for part in reversed(path) for p in part] != list(pages):
                raise AssertionError("a request's cached pages are not its locked node's path")
        for node in self._nodes():
            if node.lock_ref != locks[node]:
                raise AssertionError(f"radix cache node {node.key[:P]}...: lock_ref {node.lock_ref}, "
                                     f"but {locks[node]} requests read through it")

    def _insert(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple[int, list[int], PrefixMatch]:
        """insert(), also returning the caller's duplicate pages and the match of the whole key."""
        key = tuple(tokens[: len(tokens) - len(tokens) % self.page_size])  # whole pages
        if len(pages) != len(key) // self.page_size:
            need = len(key) // self.page_size
            raise ValueError(f"insert of {len(key)} whole-page tokens needs {need} pages, got {len(pages)}")
        node, tree_pages = self._descend(key, len(key))
        cached = len(tree_pages) * self.page_size
        if cached < len(key):
            leaf = TreeNode(key[cached:], list(pages[len(tree_pages) :]), node, self._clock)
            node.children[leaf.key[: self.page_size]] = leaf
            self._evictable += len(leaf.key)
            self._num_nodes += 1
            self._push(leaf)
            node = leaf
        duplicates = [p for p, q in zip(pages, tree_pages) if p != q]
        return cached, duplicates, PrefixMatch(len(key), tree_pages + list(pages[len(tree_pages) :]), node)

    def _descend(self, tokens: Sequence[int], length: int) -> tuple[TreeNode, list[int]]:
        """Follow the longest cached prefix of ``tokens[:length]`` (whole pages), marking the
        path as just used. Splits the last edge if the prefix ends inside it; returns the node
        ending at the prefix and the pages along the way. Pages of ``tokens`` are read one at a
        time as the walk goes, so a long request that matches little costs little (the waiting
        queue is matched whole on every prefill attempt under the cache-aware policies)."""
        P = self.page_size
        self._clock += 1
        node, pages, pos = self._root, [], 0
        node.last_access = self._clock
        while pos < length and (child := node.children.get(tuple(tokens[pos : pos + P]))) is not None:
            common = P  # the first page matched: it is the child's dict key
            key, limit = child.key, min(len(child.key), length - pos)
            while common < limit and key[common : common + P] == tuple(
                    tokens[pos + common : pos + common + P]):
                common += P
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = self._clock
            pages.extend(child.pages)
            pos += common
            node = child
        return node, pages

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut `node`'s edge after `at` tokens; the new upper node is returned. `node` keeps the
        lower part, so a lock held through it still ends where it did. Sizes are unchanged."""
        P = self.page_size
        upper = TreeNode(node.key[:at], node.pages[: at // P], node.parent, node.last_access)
        upper.lock_ref, self._num_nodes = node.lock_ref, self._num_nodes + 1
        upper.children[node.key[at : at + P]] = node
        node.parent.children[node.key[:P]] = upper
        node.key, node.pages, node.parent = node.key[at:], node.pages[at // P :], upper
        return upper

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
