"""Speculative decoding's pieces without an engine: the rejection sampler keeps the target's
distribution (chi-square against it, and the same test rejecting a sampler that keeps every
draft), the n-gram lookup, a verify step's sampling rows."""

from __future__ import annotations

import numpy as np
import pytest

from minijax_serve.core.request import Req
from minijax_serve.core.sampling_params import SamplingParams
from minijax_serve.executor.buckets import StepShape
from minijax_serve.executor.forward_batch import SAMPLING_FIELDS, empty_forward_batch
from minijax_serve.speculative.ngram import NgramProposer, lookup
from minijax_serve.speculative.rejection import verify_rows

V, N = 6, 12000  # vocabulary, rows (each a sample with its own seed)


def chi_square(observed: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """(statistic, critical value at p = 1e-4 by Wilson-Hilferty) over the expected > 0 cells."""
    keep = expected > 0
    stat = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.72  # the normal's 1 - 1e-4 quantile
    return stat, df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def _rows(temperature: float, top_k: int) -> np.ndarray:
    fb = empty_forward_batch(StepShape(0, N, 0))
    fb.temperature[:], fb.top_k[:], fb.seed[:] = temperature, top_k, np.arange(N)
    fb.kv_lens[:] = 17 + np.arange(N) % 5  # positions
    return np.concatenate([getattr(fb, f).view(np.int32).ravel() for f in SAMPLING_FIELDS])


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 4)])
def test_rejection_sampling_keeps_the_target_distribution(temperature, top_k):
    logits = np.array([2.0, 1.5, 0.3, 0.0, -1.0, 1.0], np.float32)
    scaled = logits / temperature
    kept = np.argsort(-scaled)[:top_k if top_k > 0 else V]
    p = np.zeros(V)
    p[kept] = np.exp(scaled[kept] - scaled[kept].max())
    p /= p.sum()
    q = np.array([0.05, 0.4, 0.3, 0.05, 0.1, 0.1], np.float32)  # far from p
    rng = np.random.default_rng(0)
    drafts = rng.choice(V, size=N, p=q / q.sum()).astype(np.int32)
    tokens, accepted = verify_rows(
        N, np.tile(logits, (N, 1)), _rows(temperature, top_k), drafts, np.ones(N, bool),
        np.stack([np.zeros(N), np.arange(N)], 1).astype(np.int32), np.zeros(N, np.int32),
        np.tile(q, (N, 1)))
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    assert (tokens[accepted] == drafts[accepted]).all() and 0.2 < accepted.mean() < 0.9
    stat, critical = chi_square(np.bincount(tokens, minlength=V), N * p)
    assert stat < critical, (stat, critical)
    naive, _ = chi_square(np.bincount(drafts, minlength=V), N * p)  # keeping every draft: q
    assert naive > 10 * critical


def test_point_mass_drafts_are_judged_by_the_sampled_token():
    """n-gram and greedy drafts: accepted exactly where the plain sampler drew them; the row's
    token is the plain sampler's."""
    sampled = np.arange(N, dtype=np.int32) % V
    drafts = np.where(np.arange(N) % 3 == 0, sampled, (sampled + 1) % V).astype(np.int32)
    drafts[-5:] = -1  # rows after a sequence's last draft
    tokens, accepted = verify_rows(N, np.zeros((N, V), np.float32), _rows(1.0, -1), drafts,
                                   np.zeros(N, bool), np.zeros((N, 2), np.int32), sampled,
                                   np.zeros((1, V), np.float32))
    assert (np.asarray(tokens) == sampled).all()
    assert (np.asarray(accepted) == ((drafts == sampled) & (drafts >= 0))).all()


def test_ngram_lookup():
    t = np.array([1, 2, 3, 4, 5, 1, 2, 3], np.int32)
    assert lookup(t, 3, 1, 4) == [4, 5, 1]  # the suffix 1 2 3 followed by 4 5 1
    assert lookup(t, 3, 4, 4) == []  # no earlier match of 4 tokens
    assert lookup(np.array([7, 7, 7, 7], np.int32), 3, 1, 4) == [7]  # only one token follows
    # the latest match with k tokens after it, else the earliest
    t = np.array([5, 9, 1, 5, 8, 2, 6, 5], np.int32)
    assert lookup(t, 2, 1, 2) == [8, 2] and lookup(t, 5, 1, 2) == [9, 1, 5, 8, 2]
    assert lookup(np.array([3], np.int32), 2, 1, 4) == []


def test_ngram_proposer_follows_the_outputs():
    req = Req("r", [1, 2, 3, 4], SamplingParams(), 0, 0.0)
    proposer = NgramProposer(2, 3)
    assert proposer.propose(req, 2) == []
    req.output_ids += [9, 2, 3]
    assert proposer.propose(req, 2) == [4, 9]
    req.output_ids += [4] * 200  # the array grows
    assert proposer.tokens(req).tolist() == req.token_ids(0, 207)
    assert proposer.propose(req, 3) == [4, 4, 4]
