"""The scheduler's ledgers under speculative decoding, without a model: random drafts of random
lengths (cut to the free pages), each verify accepting a random prefix of them (EOS and stop
tokens among the drafts, so a run is cut inside), with aborts, forced and real retracts,
chunked and mixed prefill, radix cache on and off, with and without overlap;
``check_invariants`` after every launch and every processed step (no page leaked by a draft)."""

from __future__ import annotations

import random

import pytest

from minijax_serve.core.request import FinishReason
from minijax_serve.speculative.speculator import Speculator
from tests.scheduler.test_scheduler_fuzz import EOS, STOP, add_requests, build, run


def speculator(rng: random.Random, scheduler) -> Speculator:
    """A Speculator of random drafts (up to 1-5 per request), wired into ``scheduler``."""
    def propose(req, k):
        return [rng.choice([*EOS, STOP, *range(10, 30)]) for _ in range(rng.randint(0, k))]

    spec = Speculator(k=rng.randint(1, 5), max_running=scheduler.limits.max_running, runner=None,
                      table=scheduler.table, scratch_slot=scheduler.slots.scratch_slot,
                      proposer=propose)
    scheduler.propose = spec.propose
    return spec


@pytest.mark.parametrize("overlap", [True, False])
def test_random_drafts_keep_the_ledgers_consistent(overlap):
    retracts = aborted = proposed = accepted = 0
    for seed in range(150):
        rng = random.Random(seed)
        scheduler, buckets = build(rng)
        spec = speculator(rng, scheduler)
        reqs = add_requests(rng, scheduler)
        run(rng, scheduler, buckets, reqs, overlap, seed, abort_rate=0.05, spec=spec)
        retracts += scheduler.num_retracted
        aborted += sum(r.finish_reason == FinishReason.ABORT for r in reqs)
        assert scheduler.allocator.num_free + scheduler.cache.evictable_size // \
            scheduler.allocator.page_size == scheduler.allocator.total_pages
        proposed += spec.counts["spec_proposed_tokens"]
        accepted += spec.counts["spec_accepted_tokens"]
    assert retracts > 0 and aborted > 0
    assert 0 < accepted < proposed
