"""Schedule policies: the order in which waiting requests are offered to the PrefillAdder.

- ``fcfs``: arrival order.
- ``lpm``: longest cached prefix first; above ``lpm_max_queue`` waiting requests it falls back to
  fcfs (matching every waiting request every step would cost more than it saves).
- ``dfs-weight``: each prefix-cache node weighs the number of waiting requests whose match ends at
  or below it; requests are ordered by a depth-first walk that visits heavier children first, so
  requests sharing a subtree are admitted together while it is cached.
- ``lof``: longest output (``max_new_tokens``) first.
- ``random``: a shuffle, seeded by ``EngineConfig.seed``.

Sorts are stable: ties keep arrival order. The prefix matches computed to order the queue are
handed back, so admission in the same step reuses them (nothing is evicted or inserted between
ordering and admission, so they stay valid).
"""

from __future__ import annotations

import collections
import random
from typing import NamedTuple, Sequence

from minijax_serve.core.request import Req
from minijax_serve.memory.prefix_cache import PrefixCache, PrefixMatch, TreeNode


class Ordered(NamedTuple):
    reqs: list[Req]
    matches: dict[str, PrefixMatch]  # by request id: the matches computed while ordering


def match_waiting(cache: PrefixCache, req: Req) -> PrefixMatch:
    """The cached prefix a waiting request can use: whole pages of all its tokens but the last,
    whose logits the request needs (so at least one token is always computed)."""
    return cache.match_prefix(req.token_ids(0, req.seq_len - 1))


class SchedulePolicy:
    """Orders the waiting queue once per prefill attempt (``name`` in POLICY_NAMES, checked by
    EngineConfig.validate)."""

    def __init__(self, name: str, cache: PrefixCache, *, lpm_max_queue: int, seed: int):
        self.name = name
        self.cache = cache
        self.lpm_max_queue = lpm_max_queue
        self._rng = random.Random(seed)

    def order(self, waiting: Sequence[Req]) -> Ordered:
        """The waiting requests in the order to try admitting them."""
        name = self.name
        if name == "lpm" and len(waiting) > self.lpm_max_queue:
            name = "fcfs"
        if name == "fcfs":
            return Ordered(list(waiting), {})
        if name == "lof":
            return Ordered(sorted(waiting, key=lambda r: -r.params.max_new_tokens), {})
        if name == "random":
            reqs = list(waiting)
            self._rng.shuffle(reqs)
            return Ordered(reqs, {})
        matches = {r.rid: match_waiting(self.cache, r) for r in waiting}
        if name == "lpm":
            return Ordered(sorted(waiting, key=lambda r: -matches[r.rid].length), matches)
        return Ordered(dfs_weight_order(waiting, {rid: m.node for rid, m in matches.items()}), matches)


def dfs_weight_order(waiting: Sequence[Req], nodes: dict[str, TreeNode]) -> list[Req]:
    """Order ``waiting`` by a depth-first walk of the tree their match nodes (``nodes``, by request
    id) span: a node's own requests first, then its children, heaviest (most waiting requests
    below) first. Only the paths from those nodes up to the root are visited."""
    at_node: dict[TreeNode, list[Req]] = collections.defaultdict(list)
    for req in waiting:
        at_node[nodes[req.rid]].append(req)
    weight: collections.Counter[TreeNode] = collections.Counter()
    children: dict[TreeNode, dict[TreeNode, None]] = collections.defaultdict(dict)  # ordered set
    root = None
    for node, reqs in at_node.items():
        while node.parent is not None:
            weight[node] += len(reqs)
            children[node.parent][node] = None
            node = node.parent
        root = node
    order: list[Req] = []
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        order.extend(at_node.get(node, ()))
        heaviest_first = sorted(children.get(node, ()), key=lambda c: -weight[c])
        stack.extend(reversed(heaviest_first))
    return order
