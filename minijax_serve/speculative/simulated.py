"""Proposals for a simulated engine: its tokens are dummies that follow the position
(:meth:`~minijax_serve.simulate.runner.SimulatedRunner.dummy_tokens`), so a proposal is the
token the simulated device will sample at that position with probability ``acceptance``, and
another token otherwise; a verify then accepts each proposed token with that probability, until
the first miss (a pure function of the request's seed and the position)."""

from __future__ import annotations

import numpy as np

from minijax_serve.core.request import Req
from minijax_serve.simulate.runner import SimulatedRunner


def unit_hash(seed: int, positions: np.ndarray) -> np.ndarray:
    """A number in [0, 1) per position, a pure function of (seed, position) (splitmix64)."""
    x = (np.full(len(positions), seed, np.uint64) * np.uint64(0x9E3779B97F4A7C15)
         + positions.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9))
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53


class SimulatedProposer:
    def __init__(self, runner: SimulatedRunner, acceptance: float):
        self.runner, self.acceptance = runner, acceptance

    def propose(self, req: Req, k: int) -> list[int]:
        """``k`` tokens after ``req``'s last one (positions ``seq_len`` on)."""
        positions = req.seq_len + np.arange(k)
        right = self.runner.dummy_tokens(positions)
        wrong = (right + 1) % self.runner.token_range
        return np.where(unit_hash(req.seed, positions) < self.acceptance, right, wrong).tolist()
