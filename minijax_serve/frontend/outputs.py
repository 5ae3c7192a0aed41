"""OutputRouter: every request the engine knows, whose output is waiting for which caller.

One loop serves every caller. A tick marks the requests whose output changed (a token reached
the host, or an abort); each caller takes its own: ``generate`` and ``stream`` the requests they
submitted (they *own* them), ``step`` every other one, ``get_output`` any one by id. Taking an
output hands it over (a new :class:`RequestOutput`): the next one's deltas start there. A finished request
is kept until its final output is taken; at most ``max_unread_finished`` unowned ones wait, the
oldest dropped beyond that (a caller that never reads them cannot grow the engine's memory).
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from minijax_serve.core.request import Logprobs, Req, RequestOutput

MAX_UNREAD_FINISHED = 4096


def logprob_dicts(values: np.ndarray, ids: np.ndarray, k: int) -> list[Logprobs]:
    """Rows of (values, ids) [N, K+1] (the chosen token in column 0, then the top K) -> one
    ``{token id: logprob}`` per row: the chosen token first, then the top ``k`` not chosen."""
    out = []
    for vals, toks in zip(values[:, :k + 1].tolist(), ids[:, :k + 1].tolist()):
        d = {toks[0]: vals[0]}
        for t, v in zip(toks[1:], vals[1:]):
            d.setdefault(t, v)
        out.append(d)
    return out


class OutputRouter:
    def __init__(self, max_unread_finished: int = MAX_UNREAD_FINISHED):
        self.max_unread_finished = max_unread_finished
        self.reqs: dict[str, Req] = {}  # every request not finished-and-read, by id
        self.groups: dict[str, tuple[str, ...]] = {}  # parent id -> its samples' ids (n > 1)
        self._parent: dict[str, str] = {}  # sample id -> parent id
        self._ready: dict[str, Req] = {}  # requests with output not handed over yet
        self._owned: set[str] = set()  # requests a running generate / stream call takes
        self._unread_finished: dict[str, None] = {}  # unowned finished requests, oldest first

    def in_use(self, request_id: str) -> bool:
        return request_id in self.reqs or request_id in self.groups

    def add(self, parent: str, reqs: list[Req]) -> None:
        """Register the samples of one prompt, submitted under ``parent``."""
        for req in reqs:
            self.reqs[req.rid] = req
        if len(reqs) > 1:
            self.groups[parent] = tuple(r.rid for r in reqs)
            self._parent.update((r.rid, parent) for r in reqs)

    def lookup(self, request_id: str) -> list[Req]:
        """The request of that id, or the samples of that parent id (empty if unknown)."""
        ids = self.groups.get(request_id, (request_id,))
        return [self.reqs[i] for i in ids if i in self.reqs]

    def mark(self, reqs: Iterable[Req]) -> None:
        """``reqs`` have new output (a token, a final state) for their callers."""
        ready, owned = self._ready, self._owned
        for req in reqs:
            ready[req.rid] = req
            if req.finish_reason is not None and req.rid not in owned:
                self._unread(req.rid)

    def _unread(self, rid: str) -> None:
        self._unread_finished[rid] = None
        while len(self._unread_finished) > self.max_unread_finished:
            oldest = next(iter(self._unread_finished))
            self._ready.pop(oldest, None)
            self._drop(oldest)

    def _drop(self, rid: str) -> None:
        self.reqs.pop(rid, None)
        self._unread_finished.pop(rid, None)
        parent = self._parent.pop(rid, None)
        if parent is not None and not any(i in self.reqs for i in self.groups[parent]):
            del self.groups[parent]

    def take(self, req: Req) -> RequestOutput:
        """Hand ``req``'s output over (forgetting it if it is finished)."""
        self._ready.pop(req.rid, None)
        if req.finish_reason is not None:
            self._drop(req.rid)
        return RequestOutput(req)

    def take_unowned(self) -> list[RequestOutput]:
        """Hand over the output of every changed request no generate / stream call owns."""
        if not self._ready:
            return []
        if self._owned:
            return [self.take(r) for r in list(self._ready.values()) if r.rid not in self._owned]
        reqs = list(self._ready.values())  # the common case: one dict, no per-request pops
        self._ready.clear()
        outs = [RequestOutput(r) for r in reqs]
        for req in reqs:
            if req.finish_reason is not None:
                self._drop(req.rid)
        return outs

    def has_unowned(self) -> bool:
        """Some output waits for ``step`` (its request's caller is no generate / stream)."""
        return any(rid not in self._owned for rid in self._ready)

    def ready(self, reqs: Iterable[Req]) -> list[Req]:
        """Those of ``reqs`` with output not handed over yet, in order."""
        return [r for r in reqs if r.rid in self._ready]

    def own(self, reqs: Iterable[Req]) -> None:
        self._owned.update(r.rid for r in reqs)

    def disown(self, reqs: Iterable[Req]) -> None:
        """The caller owning ``reqs`` is done: unread finished ones wait for ``step``."""
        for req in reqs:
            self._owned.discard(req.rid)
            if req.finished and req.rid in self._ready:
                self._unread(req.rid)

    def forget(self, reqs: Iterable[Req]) -> None:
        """Drop ``reqs`` (finished) and their unread output: their caller is gone."""
        for req in reqs:
            self._owned.discard(req.rid)
            self._ready.pop(req.rid, None)
            self._drop(req.rid)
