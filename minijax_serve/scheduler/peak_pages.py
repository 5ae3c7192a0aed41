"""The most pages requests will need at once (exact admission of ``ignore_eos`` requests), in
O(n log n) of the requests: the admission of a step with a thousand holders costs microseconds
a request, not the milliseconds of evaluating every request at every future time."""

from __future__ import annotations

import numpy as np


def peak_new_pages(seq: np.ndarray, held: np.ndarray, left: np.ndarray, ends: np.ndarray,
                   frees: np.ndarray, page_size: int) -> int:
    """The most pages, beyond the ``held`` ones, that requests need at any one time from now on,
    if request i writes ``left[i]`` more tokens after its ``seq[i]`` and then, where ``ends[i]``,
    gives back ``frees[i]`` of its held pages and all those it grew by (else it keeps them).

    Between two ends the need only grows, so it is checked at each request's last token t (a
    distinct ``left``): requests with ``left < t`` are done (``-frees`` if they end, else their
    final growth), the others have written t tokens: ``ceil((seq + t) / page_size) - held``.
    With ``seq = q·page_size + r`` that is ``q + ceil((r + t) / page_size) - held``: sums of
    ``q - held`` and counts per remainder r over the requests not done, by suffix sums over the
    requests sorted by ``left``.
    """
    if not len(seq):
        return 0
    return int(need_at(np.unique(left), seq, held, left, ends, frees, page_size).max())


def need_at(times: np.ndarray, seq: np.ndarray, held: np.ndarray, left: np.ndarray,
            ends: np.ndarray, frees: np.ndarray, page_size: int) -> np.ndarray:
    """The pages beyond the held ones that the requests need at each of ``times`` (in any
    order), as :func:`peak_new_pages` counts them."""
    times = np.asarray(times, np.int64)
    if not len(seq):
        return np.zeros(len(times), np.int64)
    ps = page_size
    order = np.argsort(left, kind="stable")
    seq, held, left = (np.asarray(x, np.int64)[order] for x in (seq, held, left))
    ends, frees = np.asarray(ends, bool)[order], np.asarray(frees, np.int64)[order]
    final = np.where(ends, -frees, -(-(seq + left) // ps) - held)  # once done
    done = np.searchsorted(left, times, side="left")  # requests done before each time
    q, r = seq // ps, seq % ps
    suffix = lambda x: np.concatenate([np.cumsum(x[::-1], axis=0)[::-1], x[:1] * 0])  # noqa: E731
    counts = np.zeros((len(seq), ps), np.int64)
    counts[np.arange(len(seq)), r] = 1
    grown = -(-(np.arange(ps)[None, :] + times[:, None]) // ps)  # ceil((r + t) / ps)
    return (np.concatenate([[0], np.cumsum(final)])[done] + suffix(q - held)[done]
            + (suffix(counts)[done] * grown).sum(axis=1))


class FutureNeed:
    """:func:`need_at` at every member's last token, kept as members join one at a time (exact
    admission in one step: the holders, then each request admitted), in O(members) a join.

    Member i will write ``left[i]`` more tokens after its ``seq[i]``, holds ``held[i]`` pages,
    and when it ``ends`` gives back those of its held pages that no other member shares: its
    pages the prefix cache owns (``pages``, which other members may borrow too) count as kept
    while another member holds them.
    """

    def __init__(self, page_size: int, seq, held, left, ends, pages: np.ndarray,
                 owners: np.ndarray):
        self.ps = page_size
        self.seq, self.held, self.left = (np.asarray(x, np.int64) for x in (seq, held, left))
        self.ends = np.asarray(ends, bool)
        pages, owners = np.asarray(pages, np.int64), np.asarray(owners, np.int64)
        self.ids, first, self.counts = np.unique(pages, return_index=True, return_counts=True)
        self.owner = owners[first]  # the member holding a page, where only one does
        shared = np.isin(pages, self.ids[self.counts > 1])
        kept = np.bincount(owners[shared], minlength=len(self.seq))
        self.frees = self.held - kept
        self.extra: dict[int, list[int]] = {}  # page -> members joined since, holding it
        self.times = np.unique(self.left)
        self.need = need_at(self.times, self.seq, self.held, self.left, self.ends, self.frees,
                            page_size)

    def _holders_of(self, pages: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """How many members hold each page, and the members that hold a page alone."""
        at = np.minimum(np.searchsorted(self.ids, pages), max(len(self.ids) - 1, 0))
        base = np.zeros(len(pages), np.int64)
        if len(self.ids):
            base = np.where(self.ids[at] == pages, self.counts[at], 0)
        total, alone = base.copy(), []
        for j, page in enumerate(pages.tolist()):
            extra = self.extra.get(page, ())
            total[j] += len(extra)
            if total[j] == 1:
                alone.append(int(self.owner[at[j]]) if base[j] else extra[0])
        return total, alone

    def _join(self, seq: int, held: int, left: int, ends: bool, pages,
              commit: bool) -> int:
        """The peak need with one more member; with ``commit``, it joins."""
        pages = np.asarray(pages, np.int64)
        total, alone = self._holders_of(pages)
        frees = held - int((total >= 1).sum())
        delta = np.zeros(len(self.times), np.int64)  # members that now share a page keep it
        for m in alone:
            delta[self.times > self.left[m]] += bool(self.ends[m])
        t = self.times
        mine = np.where(ends & (left < t), -frees, -(-(seq + np.minimum(t, left)) // self.ps) - held)
        need = self.need + delta + mine
        frees_all = self.frees.copy()
        np.subtract.at(frees_all, np.array(alone, np.int64), 1)
        members = [np.append(x, v) for x, v in ((self.seq, seq), (self.held, held),
                                                (self.left, left), (self.ends, ends),
                                                (frees_all, frees))]
        i = int(np.searchsorted(self.times, left))
        new_time = i == len(t) or t[i] != left
        at_left = need_at([left], *members, self.ps) if new_time else np.zeros(0, np.int64)
        if commit:
            self.seq, self.held, self.left, self.ends, self.frees = members
            self.need = need
            if new_time:
                self.times = np.insert(self.times, i, left)
                self.need = np.insert(self.need, i, at_left[0])
            for page in pages.tolist():
                self.extra.setdefault(page, []).append(len(self.seq) - 1)
        return int(np.concatenate([need, at_left]).max())

    def peak_with(self, seq: int, held: int, left: int, ends: bool, pages) -> int:
        """The most pages needed at once if a member of these joined."""
        return self._join(seq, held, left, ends, pages, commit=False)

    def add(self, seq: int, held: int, left: int, ends: bool, pages) -> None:
        """A member joins."""
        self._join(seq, held, left, ends, pages, commit=True)

    def allocated(self, new_pages: int, fresh_pages) -> bool:
        """The last member now holds ``new_pages`` more pages, of which ``fresh_pages`` (no other
        member holds them) the cache owns; False (nothing changed) if one of those is held by
        another member: build anew then."""
        fresh = np.asarray(fresh_pages, np.int64)
        if len(fresh) and (self._holders_of(fresh)[0] > 0).any():
            return False
        m = len(self.seq) - 1
        self.held[m] += new_pages
        self.frees[m] += new_pages
        self.need -= new_pages
        for page in fresh.tolist():
            self.extra.setdefault(page, []).append(m)
        return True
