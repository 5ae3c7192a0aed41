"""The scheduler, its ledgers and the lowering under random workloads, without a model.

A stand-in for the engine loop samples random tokens (EOS and stop tokens among them), finishes
some requests on a "stop string" while their next step may be in flight, and runs with and
without overlap, chunked and mixed prefill, forced retracts, radix cache on and off, every
schedule policy, on pools small enough to retract for real. After every launch and every
processed step the ledgers must be consistent (``check_invariants``, which includes the slot
table's mirror), and every request must finish with a consistent output.
"""

from __future__ import annotations

import random
import types

import numpy as np
import pytest

from minijax_serve.core.request import FinishReason, Req
from minijax_serve.core.sampling_params import SamplingParams
from minijax_serve.executor.buckets import Buckets
from minijax_serve.executor.forward_batch import lower
from minijax_serve.memory import NoPrefixCache, PageAllocator, RadixCache, RequestSlots, SlotTable
from minijax_serve.scheduler import Scheduler, SchedulerLimits
from minijax_serve.scheduler.invariants import check_step_writes
from minijax_serve.scheduler.policy import SchedulePolicy
from minijax_serve.scheduler.retract import NewTokenRatio

EOS, STOP, CONTEXT = (2, 7), 9, 64


def build(rng: random.Random, exact: bool = False) -> tuple[Scheduler, Buckets]:
    """A scheduler with random knobs; ``exact``: no forced retracts."""
    ps, max_running = rng.choice([1, 2, 4]), rng.choice([2, 3, 5])
    allocator = PageAllocator(rng.choice([20, 40, 80]) // ps + 1, ps)
    radix = rng.random() < 0.7
    cache = (RadixCache if radix else NoPrefixCache)(allocator)
    limits = SchedulerLimits(
        max_running=max_running, max_prefill_tokens=48,
        chunk_tokens=rng.choice([None, 4, 8, 16]), mixed=rng.random() < 0.5,
        retract_policy=rng.choice(["length", "fcfs"]),
        force_retract_every=0 if exact else rng.choice([0, 0, 3, 7]),
        exact_ignore_eos=rng.random() < 0.5)
    # mixing, the engine's unified steps: every step's shape from one ladder of token counts
    buckets = Buckets.build(max_step_tokens=128, max_running_requests=max_running,
                            context_length=CONTEXT, page_size=ps, min_token_bucket=4,
                            min_seq_bucket=1, min_kv_bucket=None,
                            unified=limits.mixed and limits.chunk_tokens is not None)
    policy = SchedulePolicy(rng.choice(["fcfs", "lpm", "dfs-weight", "lof"]), cache,
                            lpm_max_queue=128, seed=0)
    scheduler = Scheduler(allocator=allocator, slots=RequestSlots(max_running),
                          table=SlotTable(max_running, buckets.pages[-1]), cache=cache,
                          policy=policy, limits=limits, ratio=NewTokenRatio(0.7, 0.1, 50, 20),
                          eos_ids=EOS)
    return scheduler, buckets


def add_requests(rng: random.Random, scheduler: Scheduler, ignore_eos: float = 0.2,
                 stops: bool = True) -> list[Req]:
    """Random requests, each ``ignore_eos`` with that probability; ``stops``: some have a stop
    token and a min_new_tokens."""
    shared = [rng.randrange(3, 30) for _ in range(20)]  # common prefixes for the cache
    reqs = []
    for i in range(rng.randint(3, 12)):
        n = rng.randint(1, 30)
        prompt = shared[:rng.randint(0, n)]
        prompt += [rng.randrange(3, 30) for _ in range(n - len(prompt))]
        max_new = rng.randint(1, min(30, CONTEXT - n))
        if scheduler.allocator.pages_for(n + max_new) > scheduler.allocator.total_pages:
            continue  # the engine rejects it at submission
        min_new, stop = rng.choice([0, 0, max_new // 2]), rng.choice([(), (STOP,)])
        params = SamplingParams(max_new_tokens=max_new, min_new_tokens=min_new if stops else 0,
                                temperature=rng.choice([0.0, 0.7]), stop_token_ids=stop if stops else (),
                                ignore_eos=rng.random() < ignore_eos)
        reqs.append(Req(str(i), prompt, params, rng.randrange(2**32), 0.0))
        scheduler.add(reqs[-1])
    return reqs


def run(rng: random.Random, scheduler: Scheduler, buckets: Buckets, reqs: list[Req], overlap: bool,
        seed: int, stop_strings: bool = True, abort_rate: float = 0.0,
        late: list[Req] = (), spec=None) -> int:
    """Drive the scheduler to the end like the engine loop, checking the ledgers at every tick
    and each request's output at the end; ``stop_strings``: some requests finish early on a
    (pretend) stop string; ``abort_rate``: each tick may abort a random unfinished request
    (waiting, mid-prefill, running, computing a page others borrow in the step in flight);
    ``late``: requests added a few at a time, between ticks; ``spec``: a Speculator whose
    drafts each verify accepts a random prefix of (its tokens taken at once, as the engine
    does). Returns how many prefix pages requests read in the step that wrote them (pages
    shared within a step)."""
    in_flight, ticks, late, in_step = None, 0, list(late), 0

    def take(done) -> None:
        for req in [done[0].reqs[i] for i in scheduler.process(*done, now=float(ticks))]:
            if stop_strings and not req.finished and rng.random() < 0.05:
                req.finish_reason = FinishReason.STOP
                scheduler.release(req, float(ticks))

    while scheduler.has_unfinished() or in_flight is not None or late:
        ticks += 1
        assert ticks < 5000, f"seed {seed}: no progress"
        for _ in range(min(rng.randint(0, 3), len(late))):
            scheduler.add(late.pop(0))
        unfinished = [r for r in reqs if not r.finished and (r.slot is not None or r in scheduler.waiting)]
        if unfinished and rng.random() < abort_rate:
            scheduler.abort(rng.choice(unfinished), float(ticks))
        if spec is not None and in_flight is not None and spec.needs_sync(in_flight[0]):
            take(in_flight)
            in_flight = None
        batch, launched = scheduler.schedule(), None
        if batch is not None:
            verify = batch.drafts is not None
            check_step_writes(batch, scheduler.allocator.page_size)
            in_step += shared_in_step(batch, scheduler.allocator.page_size)
            num_pages = max(len(r.pages) for r in batch.reqs)
            shape = (buckets.prefill_shape(sum(batch.new_tokens), num_pages) if batch.is_prefill
                     or verify else buckets.decode_shape(len(batch.reqs), num_pages))
            fb = lower(batch, scheduler.table, shape, scheduler.allocator.page_size,
                       scheduler.slots.scratch_slot)
            assert fb.kv_lens[:len(batch.reqs)].tolist() == [
                r.kv_len + n for r, n in zip(batch.reqs, batch.new_tokens)]
            scheduler.launched(batch)
            tokens = np.array([random_token(rng) for _ in range(shape.num_seqs)])
            if verify:
                tokens = verified(rng, spec, batch, fb)
            launched = (batch, tokens)
        scheduler.check_invariants()
        if overlap and (launched is None or launched[0].drafts is None):
            done, in_flight = [in_flight], launched
        else:  # a verify's tokens at once, after those of the step before it
            done, in_flight = [in_flight, launched], None
        for step in done:
            if step is not None:
                take(step)
        scheduler.check_invariants()
    for req in reqs:
        n, p = len(req.output_ids), req.params
        assert req.slot is None and req.pages == [] and n <= p.max_new_tokens
        if req.finish_reason == FinishReason.ABORT:
            continue
        assert n >= 1
        if req.finish_reason == FinishReason.LENGTH:
            assert n == p.max_new_tokens
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS))
        first = max(p.min_new_tokens - 1, 0)  # a stop counts from the min_new_tokens-th token
        assert not stops & set(req.output_ids[first:-1]), f"seed {seed}: ran past a stop"
    return in_step


def random_token(rng: random.Random) -> int:
    return rng.choice([*EOS, STOP, *range(10, 30)])


def verified(rng: random.Random, spec, batch, fb) -> list[list[int]]:
    """A verify's runs: each row's input ids are its last token and its drafts; a random prefix
    of the drafts is accepted, then a token that is not the next draft (``spec.runs``)."""
    rows, starts = [], np.cumsum(batch.new_tokens) - batch.new_tokens
    for o, d in zip(starts.tolist(), batch.drafts):
        assert fb.input_ids[o + 1:o + 1 + len(d)].tolist() == d
        accepted, token = rng.randint(0, len(d)), random_token(rng)
        while accepted < len(d) and token == d[accepted]:
            token = random_token(rng)
        rows += d[:accepted] + [token] + [0] * (len(d) - accepted)
    return spec.runs(batch, types.SimpleNamespace(tokens=np.array(rows)))


def shared_in_step(batch, ps: int) -> int:
    """Prefix pages of the step's requests that another request of the step writes."""
    written = {p for r, start, n in zip(batch.reqs, batch.kv_starts.tolist(), batch.new_tokens)
               for p in r.pages[start // ps:(start + n - 1) // ps + 1]}
    return sum(len(written & set(r.pages[:start // ps]))
               for r, start in zip(batch.reqs, batch.kv_starts.tolist()))


@pytest.mark.parametrize("overlap", [True, False])
def test_random_workloads_keep_the_ledgers_consistent(overlap):
    retracts = 0
    for seed in range(150):
        rng = random.Random(seed)
        scheduler, buckets = build(rng)
        reqs = add_requests(rng, scheduler)
        run(rng, scheduler, buckets, reqs, overlap, seed)
        retracts += scheduler.num_retracted
    assert retracts > 0  # the pools are small enough to retract for real


@pytest.mark.parametrize("overlap", [True, False])
def test_exact_admission_of_ignore_eos_requests_never_retracts(overlap):
    """Every request ignore_eos and none stopping early: admitted by their exact future
    (chunked, mixed or not, sharing cached prefixes or not), they never find the pool short, on
    pools where the ratio rule retracts the same requests."""
    ratio_retracts = 0
    for seed in range(300):
        for exact in (True, False) if seed < 100 else (True,):
            rng = random.Random(seed)
            scheduler, buckets = build(rng, exact=True)
            scheduler.limits = scheduler.limits._replace(exact_ignore_eos=exact)
            reqs = add_requests(rng, scheduler, ignore_eos=1.0, stops=False)
            run(rng, scheduler, buckets, reqs, overlap, seed, stop_strings=False)
            if exact:
                assert scheduler.num_retracted == 0, f"seed {seed}"
            ratio_retracts += scheduler.num_retracted
    assert ratio_retracts > 0


def tree_requests(rng: random.Random, scheduler: Scheduler) -> list[Req]:
    """Prompts along the paths of a random tree of 1-8 token segments, in random order."""
    paths: list[list[int]] = []
    for _ in range(rng.randint(4, 16)):
        base = rng.choice([[]] + paths)
        segment = [rng.randrange(3, 30) for _ in range(rng.randint(1, 8))]
        if len(base) + len(segment) <= 40:
            paths.append(base + segment)
    rng.shuffle(paths)
    reqs = []
    for i, prompt in enumerate(paths):
        max_new = rng.randint(1, 12)
        if scheduler.allocator.pages_for(len(prompt) + max_new) > scheduler.allocator.total_pages:
            continue
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=rng.random() < 0.5,
                                n=1, temperature=rng.choice([0.0, 0.7]))
        reqs.append(Req(str(i), prompt, params, rng.randrange(2**32), 0.0))
    return reqs


@pytest.mark.parametrize("overlap", [True, False])
def test_prefix_trees_shared_in_step_with_aborts_and_retracts(overlap):
    """Random prefix trees arriving at once or a few at a time: requests admitted together share
    the pages one of them computes; aborts and retracts of the computing requests and of their
    borrowers keep every ledger consistent and every page written once per step."""
    shared = aborted = 0
    for seed in range(200):
        rng = random.Random(seed)
        scheduler, buckets = build(rng)
        reqs = tree_requests(rng, scheduler)
        at_once = rng.random() < 0.5
        for req in reqs if at_once else []:
            scheduler.add(req)
        shared += run(rng, scheduler, buckets, reqs, overlap, seed, abort_rate=0.05,
                      late=[] if at_once else reqs)
        aborted += sum(r.finish_reason == FinishReason.ABORT for r in reqs)
    assert shared > 0 and aborted > 0
