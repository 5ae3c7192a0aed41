"""Abort at every point of a request's life: a scheduler-level fuzz (stand-in tokens that are a
pure function of request and position, so the requests not aborted must give exactly their
tokens of a run without the aborted ones), then the engine on a tiny Llama against HF."""

from __future__ import annotations

import collections
import random
import zlib

import numpy as np
import pytest

from minijax_serve import Engine, SamplingParams
from minijax_serve.executor.forward_batch import lower
from tests.scheduler.test_chunked_prefill import TINY, prompts_and_refs  # noqa: F401
from tests.engine.test_engine import assert_idle_and_clean
from tests.scheduler.test_scheduler_fuzz import EOS, STOP, add_requests, build

TOKENS = [*EOS, STOP, *range(10, 30)]


def token_at(rid: str, position: int) -> int:
    """The stand-in model: a request's token at a position, whatever the batch."""
    return TOKENS[zlib.crc32(f"{rid}:{position}".encode()) % len(TOKENS)]


def state(scheduler, req, in_flight) -> str:
    if req.slot is None:
        return "retracted" if req.num_retracted else "waiting"
    if req is scheduler.chunked:
        return "chunked"
    if in_flight is not None and req in in_flight[0].reqs and req.num_pending:
        return "token in flight"
    return "running"


def drive(scheduler, buckets, overlap: bool, abort_rng: random.Random | None, states) -> set[str]:
    """Run to the end like the engine loop, checking the ledgers at every tick; with
    ``abort_rng``, abort random unfinished requests before scheduling and after dispatch.
    Returns the ids aborted."""
    known = list(scheduler.waiting)
    aborted, in_flight, ticks = set(), None, 0

    def maybe_abort():
        if abort_rng is None or abort_rng.random() > 0.07:
            return
        by_state = collections.defaultdict(list)  # a state first, so that rare ones are hit
        for req in known:
            if not req.finished:
                by_state[state(scheduler, req, in_flight)].append(req)
        if by_state:
            kind = abort_rng.choice(sorted(by_state))
            states[kind] += 1
            req = abort_rng.choice(by_state[kind])
            scheduler.abort(req, float(ticks))
            assert req.finish_reason == "abort" and req.slot is None and not req.pages
            aborted.add(req.rid)
            scheduler.check_invariants()

    while scheduler.has_unfinished() or in_flight is not None:
        ticks += 1
        assert ticks < 5000, "no progress"
        maybe_abort()
        batch, launched = scheduler.schedule(), None
        if batch is not None:
            num_pages = max(len(r.pages) for r in batch.reqs)
            shape = (buckets.prefill_shape(sum(batch.new_tokens), num_pages) if batch.is_prefill
                     else buckets.decode_shape(len(batch.reqs), num_pages))
            lower(batch, scheduler.table, shape, scheduler.allocator.page_size,
                  scheduler.slots.scratch_slot)
            scheduler.launched(batch)
            ends = batch.kv_starts + np.array(batch.new_tokens)
            tokens = np.array([token_at(r.rid, int(e)) for r, e in zip(batch.reqs, ends)])
            launched = (batch, tokens)
        scheduler.check_invariants()
        done, in_flight = (in_flight, launched) if overlap else (launched, None)
        maybe_abort()  # with overlap, the requests of the step just dispatched have a token in flight
        if done is not None:
            scheduler.process(*done, now=float(ticks))
        scheduler.check_invariants()
    return aborted


def test_abort_fuzz_keeps_ledgers_and_other_outputs():
    """400 random workloads (radix cache, chunking, mixing, forced retracts, overlap, on and
    off); aborts in every state; the others' outputs equal a run without the aborted ones."""
    states: collections.Counter[str] = collections.Counter()
    for seed in range(400):
        overlap = seed % 2 == 0
        scheduler, buckets = build(random.Random(seed))
        reqs = add_requests(random.Random(seed + 10_000), scheduler)
        aborted = drive(scheduler, buckets, overlap, random.Random(seed + 20_000), states)
        ps = scheduler.allocator.page_size
        assert scheduler.allocator.num_free + scheduler.cache.evictable_size // ps == \
            scheduler.allocator.total_pages, f"seed {seed}: pages held at the end"
        assert scheduler.cache.protected_size == 0
        assert scheduler.slots.num_free == scheduler.slots.num_slots
        for req in reqs:
            assert (req.finish_reason == "abort") == (req.rid in aborted), f"seed {seed}"

        clean, clean_buckets = build(random.Random(seed))
        alone = add_requests(random.Random(seed + 10_000), clean)
        clean.waiting = [r for r in clean.waiting if r.rid not in aborted]
        drive(clean, clean_buckets, overlap, None, states)
        for req, ref in zip(reqs, alone):
            if req.rid not in aborted:
                assert (req.output_ids, req.finish_reason) == (ref.output_ids, ref.finish_reason), \
                    f"seed {seed}: request {req.rid} changed by the aborts"
    assert min(states[s] for s in ("waiting", "retracted", "chunked", "running",
                                   "token in flight")) >= 10, states


@pytest.mark.parametrize("overlap", [True, False])
def test_abort_on_a_tiny_model_leaves_the_others_equal_to_hf(overlap, tiny_dir, prompts_and_refs):
    """Abort one request waiting, one mid-prompt (chunked), one decoding; the others give HF's
    tokens, the aborted ones a prefix of theirs with reason "abort"."""
    short, long, refs = prompts_and_refs
    engine = Engine(tiny_dir["llama"], page_size=16, chunked_prefill_size=32,
                    enable_overlap=overlap, **TINY)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in short + long]
    outputs, aborted, tick = {}, {}, 0
    while engine.has_unfinished():
        tick += 1
        for rid in ids:
            req = engine._router.reqs.get(rid)
            if req is None or req.finished or rid in aborted:
                continue
            if (tick == 1 and req.slot is None and rid == ids[-1]) or (
                    req is engine.scheduler.chunked and "chunked" not in aborted.values()) or (
                    req.output_ids and len(aborted) < 3 and "running" not in aborted.values()):
                kind = ("waiting" if req.slot is None else
                        "chunked" if req is engine.scheduler.chunked else "running")
                assert engine.abort(rid)
                aborted[rid] = kind
                engine.check_invariants()
        outputs.update((o.request_id, o) for o in engine.step())
        assert tick < 500
    assert sorted(aborted.values()) == ["chunked", "running", "waiting"]
    for rid, ref in zip(ids, refs):
        out = outputs[rid]
        if rid in aborted:
            assert out.finish_reason == "abort" and out.token_ids == ref[:len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.token_ids == ref
    assert engine.stats()["num_aborted"] == 3
    assert not engine.abort(ids[0]) and not engine.abort("no such id")
    assert not engine.abort(None) and not engine.abort(12) and not engine.abort(["0"])
    assert_idle_and_clean(engine)
