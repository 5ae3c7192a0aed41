"""Prompt lookup (n-gram) proposals, on the host: the tokens that followed an earlier occurrence
of the sequence's longest matching suffix (vLLM's ``ngram`` / prompt-lookup decoding).

A sequence's tokens are kept in a numpy array per request that grows with its outputs, so a
lookup costs a few vectorised comparisons over the sequence, not a copy of it.
"""

from __future__ import annotations

import weakref

import numpy as np

from minijax_serve.core.request import Req


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Up to ``k`` tokens proposed after ``tokens``: find the longest suffix of ``n_min`` to
    ``n_max`` tokens that occurs earlier in ``tokens`` and return what followed its latest
    earlier occurrence that has ``k`` tokens after it (else its earliest, which has the most);
    [] without a match."""
    end = len(tokens) - 1
    if end < n_min or k < 1:
        return []
    ends = np.flatnonzero(tokens[:-1] == tokens[end])  # where earlier matches of length 1 end
    length = 1
    while length < n_max and ends.size:
        room = ends[ends >= length]
        longer = room[tokens[room - length] == tokens[end - length]]
        if not longer.size:
            break
        ends, length = longer, length + 1
    if length < n_min or not ends.size:
        return []
    full = ends[ends + k <= end]
    start = int(full[-1] if full.size else ends[0]) + 1
    return tokens[start:start + k].tolist()


class NgramProposer:
    """Proposals from each request's own tokens (prompt and outputs, all on the host)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._arrays: weakref.WeakKeyDictionary[Req, np.ndarray] = weakref.WeakKeyDictionary()
        self._lengths: weakref.WeakKeyDictionary[Req, int] = weakref.WeakKeyDictionary()

    def tokens(self, req: Req) -> np.ndarray:
        """``req``'s sequence (prompt then outputs) as an int32 array."""
        n = len(req.prompt_ids) + len(req.output_ids)
        buf, have = self._arrays.get(req), self._lengths.get(req, 0)
        if buf is None or len(buf) < n:
            grown = np.empty(max(2 * n, 64), np.int32)
            grown[:have] = buf[:have] if buf is not None else []
            self._arrays[req] = buf = grown
        buf[have:n] = req.token_ids(have, n)
        self._lengths[req] = n
        return buf[:n]

    def propose(self, req: Req, k: int) -> list[int]:
        """Up to ``k`` tokens to verify after ``req``'s last one (:func:`lookup`)."""
        return lookup(self.tokens(req), k, self.n_min, self.n_max)
