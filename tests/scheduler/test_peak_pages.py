"""The exact admission's future need (scheduler/peak_pages.py) against the plain definition: every
request's need evaluated at every future time, shared pages counted from scratch."""

from __future__ import annotations

import numpy as np
import pytest

from minijax_serve.scheduler.peak_pages import FutureNeed, peak_new_pages


def brute_peak(seq, held, left, ends, frees, page_size) -> int:
    """The need of every request at each distinct last token, summed (O(requests × times))."""
    times = np.unique(left)[:, None]
    grown = -(-(seq + np.minimum(times, left)) // page_size) - held
    return int(np.where(ends & (left < times), -frees, grown).sum(axis=1).max())


def brute_frees(held, pages) -> np.ndarray:
    """Held pages less the cache-owned ones another member holds too."""
    ids, counts = np.unique(np.concatenate([np.asarray(p, np.int64) for p in pages] + [[]]),
                            return_counts=True)
    shared = set(ids[counts > 1].tolist())
    return np.array([h - sum(p in shared for p in ps) for h, ps in zip(held, pages)], np.int64)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_peak_new_pages_is_the_plain_sum(page_size):
    rng = np.random.default_rng(page_size)
    for _ in range(300):
        n = int(rng.integers(1, 25))
        seq = rng.integers(0, 120, n)
        held = -(-seq // page_size) - rng.integers(0, 3, n)
        left, ends, frees = rng.integers(0, 60, n), rng.random(n) < 0.5, rng.integers(0, 9, n)
        assert peak_new_pages(seq, held, left, ends, frees, page_size) == brute_peak(
            seq, held, left, ends, frees, page_size)


def _member(rng, page_size, pool_pages):
    seq = int(rng.integers(1, 100))
    pages = rng.choice(pool_pages, size=int(rng.integers(0, 4)), replace=False).tolist()
    held = max(len(pages), -(-seq // page_size) - int(rng.integers(0, 2)))
    return seq, held, int(rng.integers(0, 50)), bool(rng.random() < 0.6), pages


@pytest.mark.parametrize("page_size", [1, 16])
def test_future_need_as_members_join(page_size):
    """Members join one by one (sharing cache pages with earlier ones, or not), some then
    allocate fresh pages: the peak with a candidate, and after each change, is the plain one."""
    rng = np.random.default_rng(7 + page_size)
    for _ in range(60):
        pool = np.arange(12)  # few page ids: members often share one
        members = [_member(rng, page_size, pool) for _ in range(int(rng.integers(0, 6)))]
        flat = [p for m in members for p in m[4]]
        owners = [i for i, m in enumerate(members) for _ in m[4]]
        need = FutureNeed(page_size, *zip(*[m[:4] for m in members]) if members else ([],) * 4,
                          flat, owners)
        fresh_id = 100
        for _ in range(5):
            cand = _member(rng, page_size, pool)
            every = members + [cand]
            seq, held, left, ends = (np.array(x) for x in zip(*[m[:4] for m in every]))
            frees = brute_frees(held, [m[4] for m in every])
            expected = brute_peak(seq, held, left, ends, frees, page_size)
            assert need.peak_with(*cand) == expected
            need.add(*cand)
            members.append(cand)
            if rng.random() < 0.5:  # the newest member allocates pages, some the cache owns
                extra = int(rng.integers(1, 4))
                fresh = list(range(fresh_id, fresh_id + int(rng.integers(0, extra + 1))))
                fresh_id += len(fresh)
                assert need.allocated(extra, fresh)
                s, h, l_, e, p = members[-1]
                members[-1] = (s, h + extra, l_, e, p + fresh)
        probe = _member(rng, page_size, pool)
        every = members + [probe]
        seq, held, left, ends = (np.array(x) for x in zip(*[m[:4] for m in every]))
        frees = brute_frees(held, [m[4] for m in every])
        assert need.peak_with(*probe) == brute_peak(seq, held, left, ends, frees, page_size)


def test_allocated_pages_held_by_another_member_ask_for_a_rebuild():
    need = FutureNeed(1, [5], [5], [3], [True], [7], [0])
    need.add(4, 4, 2, True, [])
    assert not need.allocated(1, [7])  # page 7 is member 0's: the sharing changed
