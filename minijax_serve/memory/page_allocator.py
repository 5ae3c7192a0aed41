"""PageAllocator: the host ledger of free KV pages.

Page 0 is the scratch page: padding tokens write their KV there and no request ever owns it, so
pages 1..num_pages-1 are the allocatable pool.
"""

from __future__ import annotations

SCRATCH_PAGE = 0


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))  # pop() hands out low ids first
        self._is_free = [True] * num_pages
        self._is_free[SCRATCH_PAGE] = False

    @property
    def total_pages(self) -> int:
        """Allocatable pages (the scratch page excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"out of KV pages: asked for {n}, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = False
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if self._is_free[p] or p == SCRATCH_PAGE:
                raise RuntimeError(f"page {p} freed twice or never allocated")
            self._is_free[p] = True
        self._free.extend(reversed(pages))

    def free_page_ids(self) -> set[int]:
        return set(self._free)
