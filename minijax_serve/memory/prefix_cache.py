"""The prefix cache's interface: a tree node, a match, the calls the scheduler makes
(``PrefixCache``), and ``NoPrefixCache``, the same interface with nothing ever cached
(``enable_radix_cache=False``: ``cache_finished`` frees every page, so the scheduler has one code
path). :class:`minijax_serve.memory.radix_cache.RadixCache` is the real one and documents the
semantics.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

from minijax_serve.memory.page_allocator import PageAllocator


class TreeNode:
    """An edge of the radix tree with the node below it: `key` tokens, held in `pages`."""

    __slots__ = ("key", "pages", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: TreeNode | None, last_access: int):
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}  # keyed by the child's first page of tokens
        self.lock_ref = 0
        self.last_access = last_access


Borrowers = Sequence[tuple["TreeNode | None", Sequence[int]]]  # (locked node, cached pages read)


class PrefixMatch(NamedTuple):
    length: int  # matched tokens, a multiple of page_size
    pages: list[int]  # the tree's pages holding them, one per page_size tokens
    node: TreeNode  # the node ending exactly at the match: what lock/unlock take


class PrefixCache(Protocol):
    """A prefix cache's interface (the scheduler's calls, and the sizes the tests read);
    RadixCache documents the semantics."""

    @property
    def evictable_size(self) -> int: ...
    @property
    def protected_size(self) -> int: ...
    @property
    def total_pages(self) -> int: ...
    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch: ...
    def lock(self, node: TreeNode) -> None: ...
    def unlock(self, node: TreeNode) -> None: ...
    def cache_finished(self, tokens: Sequence[int], pages: Sequence[int]) -> None: ...
    def cache_unfinished(self, tokens: Sequence[int], pages: Sequence[int]) -> PrefixMatch: ...
    def evict(self, num_pages: int) -> int: ...
    def reset(self) -> None: ...
    def page_ids(self) -> set[int]: ...
    def check_invariants(self, borrowers: Borrowers | None = None) -> None: ...


def check_pages_cover(allocator: PageAllocator, tokens: Sequence[int], pages: Sequence[int]) -> None:
    """Raise ValueError unless ``pages`` hold every token of ``tokens``."""
    if len(pages) < allocator.pages_for(len(tokens)):
        need = allocator.pages_for(len(tokens))
        raise ValueError(f"{len(tokens)} tokens need {need} pages, got {len(pages)}")


class NoPrefixCache:
    """The prefix cache interface with nothing ever cached (enable_radix_cache=False)."""

    evictable_size = 0
    protected_size = 0
    total_pages = 0

    def __init__(self, allocator: PageAllocator):
        self.allocator = allocator
        self._root = TreeNode((), [], None, 0)

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch:
        """Always the empty match."""
        return PrefixMatch(0, [], self._root)

    def lock(self, node: TreeNode) -> None:
        """Nothing to protect."""

    def unlock(self, node: TreeNode) -> None:
        """Nothing to release."""

    def cache_finished(self, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Free every page of the finished request."""
        check_pages_cover(self.allocator, tokens, pages)
        self.allocator.free(list(pages))

    def cache_unfinished(self, tokens: Sequence[int], pages: Sequence[int]) -> PrefixMatch:
        """Nothing is shared: the empty match; the request keeps every page."""
        return PrefixMatch(0, [], self._root)

    def evict(self, num_pages: int) -> int:
        """Nothing to evict: 0 pages freed."""
        return 0

    def reset(self) -> None:
        """Nothing to flush."""

    def page_ids(self) -> set[int]:
        """No page is held."""
        return set()

    def check_invariants(self, borrowers: Borrowers | None = None) -> None:
        """Every borrower reads nothing: it holds the empty match."""
        if any(node is not self._root or pages for node, pages in borrowers or ()):
            raise AssertionError("a request borrows cached pages without a prefix cache")
