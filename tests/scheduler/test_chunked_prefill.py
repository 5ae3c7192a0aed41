"""Chunked prefill, mixed batches, adaptive admission and retract on tiny Llama models: every
output token-identical to HuggingFace transformers greedy (or to the same run without retract
for seeded sampling), and no page or slot leaked."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from minijax_serve import Engine, EngineConfig, SamplingParams
from minijax_serve.core.request import Req
from minijax_serve.memory import PageAllocator, SlotTable
from minijax_serve.scheduler.peak_pages import peak_new_pages
from minijax_serve.scheduler.prefill_adder import holders_reserved_pages, reserved_pages
from minijax_serve.scheduler.retract import NewTokenRatio, retract_order
from tests import hf_reference
from tests.engine.test_engine import assert_idle_and_clean

TINY = dict(skip_tokenizer_init=True, max_total_tokens=1024, max_running_requests=3,
            max_prefill_tokens=128, min_token_bucket=16, min_seq_bucket=4, min_kv_bucket=128)
NEW = 12
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
SHORT_LENS, LONG_LENS = [3, 9, 14, 20, 5], [100, 61, 90, 7]


@pytest.fixture(scope="module")
def prompts_and_refs(hf_llama):
    """Short prompts submitted first, long ones (much longer than the chunks) arriving while
    those decode, and the HF greedy continuation of each."""
    rng = np.random.default_rng(11)
    short = [rng.integers(0, 250, size=n).tolist() for n in SHORT_LENS]
    long = [rng.integers(0, 250, size=n).tolist() for n in LONG_LENS]
    refs = hf_reference.greedy(None, short + long, NEW, model=hf_llama)
    return short, long, refs


def run_arrivals(engine: Engine, short, long, params=GREEDY, decode_steps_before_long: int = 3,
                 max_steps: int = 2000):
    """Submit ``short``, step until they decode, submit ``long``, run everything to the end
    (within ``max_steps`` steps); the outputs in submission order."""
    ids = [engine.add_request(p, params) for p in short]
    outputs = {}
    for _ in range(len(short) + decode_steps_before_long):
        outputs.update((o.request_id, o) for o in engine.step())
    ids += [engine.add_request(p, params) for p in long]
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        outputs.update((o.request_id, o) for o in engine.step())
    assert not engine.has_unfinished(), f"unfinished after {max_steps} steps"
    return [outputs[i] for i in ids]


# (page size, chunk size, mixed, radix cache): pairwise coverage of the combinations
CHUNK_CASES = [(1, 4, True, True), (1, 4, False, False), (16, 16, False, True),
               (16, 16, True, False), (16, 64, True, False), (16, 64, False, True)]


@pytest.mark.parametrize("page_size,chunk,mixed,radix", CHUNK_CASES)
def test_chunked_and_mixed_match_hf(page_size, chunk, mixed, radix, tiny_dir, prompts_and_refs):
    short, long, refs = prompts_and_refs
    engine = Engine(tiny_dir["llama"], page_size=page_size, chunked_prefill_size=chunk,
                    enable_mixed_chunk=mixed, enable_radix_cache=radix, **TINY)
    outs = run_arrivals(engine, short, long)
    assert [o.token_ids for o in outs] == refs
    stats = engine.stats()
    assert stats["chunked_steps"] >= max(LONG_LENS) // chunk  # the long prompts went in chunks
    assert stats["prefill_tokens_computed"] + stats["cached_tokens"] == sum(map(len, short + long))
    if mixed and chunk > TINY["max_running_requests"] + page_size:
        assert stats["mixed_steps"] > 0
    if not mixed:
        assert stats["mixed_steps"] == 0
    assert_idle_and_clean(engine)


def test_chunk_budget_bounds_every_step(tiny_dir, prompts_and_refs):
    short, long, _ = prompts_and_refs
    engine = Engine(tiny_dir["llama"], page_size=16, chunked_prefill_size=32,
                    enable_mixed_chunk=True, **TINY)
    steps = []
    run = engine.runner.run
    engine.runner.run = lambda fb, shape, *rest: steps.append(int(fb.cu_q_lens[-1])) or run(fb, shape, *rest)
    run_arrivals(engine, short, long)
    assert 16 < max(steps) <= 32  # chunks of 16 (page-aligned) plus the decode tokens
    assert engine.buckets.tokens[-1] == 32  # no step shape beyond the chunk


# every=1 with overlap: a request retracted as its re-prefill's token is still on the way would
# be picked again every step (fewest generated tokens) and never advance, were it not skipped.
@pytest.mark.parametrize("radix,every,mixed", [(True, 3, False), (False, 1, True)])
def test_forced_retract_greedy_matches_hf(radix, every, mixed, tiny_dir, prompts_and_refs):
    short, long, refs = prompts_and_refs
    engine = Engine(tiny_dir["llama"], page_size=16, chunked_prefill_size=32,
                    enable_mixed_chunk=mixed, enable_radix_cache=radix,
                    force_retract_every=every, enable_overlap=True, **TINY)
    outs = run_arrivals(engine, short, long)
    assert [o.token_ids for o in outs] == refs
    assert engine.stats()["num_retracted"] >= 5
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("radix", [True, False])
def test_forced_retract_keeps_seeded_samples(radix, tiny_dir, prompts_and_refs):
    short, long, _ = prompts_and_refs
    params = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    runs = []
    for every in (0, 3):
        engine = Engine(tiny_dir["llama"], page_size=1, chunked_prefill_size=16,
                        enable_radix_cache=radix, force_retract_every=every, **TINY)
        runs.append([o.token_ids for o in run_arrivals(engine, short, long, params)])
        assert (engine.stats()["num_retracted"] > 0) == bool(every)
        assert_idle_and_clean(engine)
    assert runs[0] == runs[1]


@pytest.fixture(scope="module")
def overload(hf_llama):
    """200 requests (ignore_eos) with about 10x the pool's tokens, and their HF references."""
    rng = np.random.default_rng(3)
    prompts, params, refs = [], [], []
    while len(prompts) < 200:  # prompts whose HF reference has no argmax near-tie
        prompt = rng.integers(0, 250, size=int(rng.integers(4, 16))).tolist()
        max_new = int(rng.integers(20, 40))
        ref = hf_reference.greedy(None, [prompt], max_new, model=hf_llama, skip_near_ties=True)[0]
        if ref is not None:
            prompts.append(prompt)
            params.append(SamplingParams(max_new_tokens=max_new, ignore_eos=True))
            refs.append(ref)
    return prompts, params, refs


def run_overload(tiny_dir, overload, **overrides) -> Engine:
    prompts, params, refs = overload
    total = sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
    config = {**TINY, "max_total_tokens": 768, "max_running_requests": 32, "min_seq_bucket": 32,
              "min_token_bucket": 64, **overrides}
    engine = Engine(tiny_dir["llama"], page_size=4, chunked_prefill_size=64, **config)
    assert 9 <= total / engine.kv_pool_tokens <= 11
    outs = engine.generate(prompts, params)
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.token_ids for o in outs] == refs
    assert_idle_and_clean(engine)
    return engine


def test_overload_retracts_and_completes(tiny_dir, overload):
    """Real retracts, no failure, HF outputs, with the ignore_eos requests admitted by the ratio.
    It decays over 100 decode steps, not 600: this short run (~300 steps) then admits
    aggressively enough to exhaust the pool."""
    engine = run_overload(tiny_dir, overload, new_token_ratio_decay_steps=100,
                          exact_ignore_eos_admission=False)
    assert engine.stats()["num_retracted"] >= 1
    assert engine.stats()["new_token_ratio"] == engine.scheduler.ratio.init  # reset at idle


@pytest.mark.parametrize("radix", [True, False])
def test_overload_admits_ignore_eos_requests_exactly(tiny_dir, overload, radix):
    """The same overload with the default exact admission: the ignore_eos requests are admitted
    by their exact future, so the pool never runs short and nothing is retracted, however low
    the ratio."""
    stats = run_overload(tiny_dir, overload, new_token_ratio_decay_steps=100,
                         init_new_token_ratio=0.05, enable_radix_cache=radix).stats()
    assert stats["num_retracted"] == 0
    assert stats["peak_kv_tokens_used"] > 0.9 * stats["kv_pool_tokens"]


def test_peak_new_pages():
    seq, held = np.array([10, 4]), np.array([10, 4])
    left, ends = np.array([5, 16]), np.array([True, True])
    # at A's last token both grew by 5; at B's, A has freed its 10 and B grew by 16
    assert peak_new_pages(seq, held, left, ends, held, 1) == 10
    assert peak_new_pages(seq, held, np.array([5, 30]), ends, held, 1) == 30 - 10
    # A keeps its pages (it may not end): its 5 new ones stay too
    assert peak_new_pages(seq, held, left, np.array([False, True]), held, 1) == 5 + 16
    # A shares 6 of its pages with B: ending, it gives back only its other 4 and its 5 new ones
    assert peak_new_pages(seq, held, left, ends, np.array([4, 4]), 1) == 16 - 4
    # pages of 4: A 10 -> 15 tokens is 3 -> 4 pages, B 4 -> 9 is 1 -> 3 pages; a new request
    # holding nothing needs its whole prompt's pages at once
    assert peak_new_pages(np.array([10, 4]), np.array([3, 1]), left, ends, np.array([3, 1]), 4) == 1 + 2
    assert peak_new_pages(np.array([7]), np.array([0]), np.array([0]), np.array([True]),
                          np.array([2]), 4) == 2
    assert peak_new_pages(*(np.array([], np.int64),) * 5, 4) == 0


def _req(rid: str, prompt_len: int, generated: int, arrival: float, max_new: int = 100) -> Req:
    req = Req(rid, [1] * prompt_len, SamplingParams(max_new_tokens=max_new), 0, arrival)
    req.output_ids = [2] * generated
    return req


def test_new_token_ratio_decay_jump_and_reset():
    ratio = NewTokenRatio(0.7, 0.7 * 0.14, decay_steps=600, retract_decode_steps=20)
    for _ in range(300):
        ratio.on_decode_step()
    assert ratio.value == pytest.approx(0.7 - 300 * (0.7 - 0.098) / 600)
    for _ in range(400):
        ratio.on_decode_step()
    assert ratio.value == pytest.approx(0.098)  # floored at the minimum
    running = [_req("a", 10, 30, 0.0), _req("b", 10, 10, 1.0)]
    ratio.on_retract(running)  # (40 decoded + 20 x 2) / 200 max_new_tokens
    assert ratio.value == pytest.approx(0.4)
    ratio.on_retract([_req("c", 10, 95, 0.0)])
    assert ratio.value == 1.0  # capped
    ratio.reset()
    assert ratio.value == 0.7


def test_retract_order():
    reqs = [_req("few-short", 5, 1, 0.0), _req("many", 50, 9, 1.0), _req("few-long", 40, 1, 2.0),
            _req("mid", 30, 4, 3.0)]
    assert [r.rid for r in retract_order(reqs, "length")] == ["few-long", "few-short", "mid", "many"]
    assert [r.rid for r in retract_order(reqs, "fcfs")] == ["mid", "few-long", "many", "few-short"]


@pytest.mark.parametrize("fields,message", [  # raised when the config is made
    (dict(chunked_prefill_size=24),
     "chunked_prefill_size must be -1 (off) or a positive multiple of page_size=16"),
    (dict(chunked_prefill_size=0), "chunked_prefill_size"),
    (dict(chunked_prefill_size=32.0), "chunked_prefill_size must be an integer >= -1, got 32.0"),
    (dict(enable_mixed_chunk=True, chunked_prefill_size=-1),
     "enable_mixed_chunk=True needs chunked prefill, but chunked_prefill_size=-1 (off)"),
    (dict(init_new_token_ratio=1.5), "init_new_token_ratio must be in (0, 1]"),
    (dict(init_new_token_ratio="0.5"), "init_new_token_ratio must be a finite number, got '0.5'"),
    (dict(schedule_conservativeness=float("nan")), "schedule_conservativeness must be a finite"),
    (dict(retract_policy="random"), "retract_policy must be 'length' or 'fcfs'"),
    (dict(force_retract_every=-1), "force_retract_every must be an integer >= 0, got -1"),
    (dict(enable_mixed_chunk="yes"), "enable_mixed_chunk must be True, False or None"),
    (dict(exact_ignore_eos_admission=1), "exact_ignore_eos_admission must be True or False"),
    (dict(skip_tokenizer_init=1), "skip_tokenizer_init must be True or False, got 1"),
    (dict(record_steps="yes"), "record_steps must be True or False, got 'yes'"),
    (dict(max_logprobs=21), "max_logprobs must be an integer in [0, 20], got 21"),
    (dict(page_size=16.5), "page_size must be an integer >= 1, got 16.5"),
    (dict(page_size="16"), "page_size must be an integer >= 1, got '16'"),
    (dict(page_size=True), "page_size must be an integer >= 1, got True"),
    (dict(max_running_requests=2.5), "max_running_requests must be an integer >= 1, got 2.5"),
    (dict(tensor_parallel_size=1.5), "tensor_parallel_size must be an integer >= 1, got 1.5"),
    (dict(max_total_tokens=64.0), "max_total_tokens must be an integer >= 1, got 64.0"),
    (dict(min_kv_bucket=0), "min_kv_bucket must be an integer >= 1, got 0"),
    (dict(context_length=0), "context_length must be an integer >= 2, got 0"),
    (dict(context_length=-8), "context_length must be an integer >= 2, got -8"),
    (dict(seed=-1), "seed must be an integer in [0, 4294967295], got -1"),
    (dict(seed="x"), "seed must be an integer in [0, 4294967295], got 'x'"),
])
def test_config_errors(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(**fields)


def test_every_integer_field_has_its_limits():
    from minijax_serve.config.engine_config import INT_LIMITS

    annotated = {f.name for f in dataclasses.fields(EngineConfig) if "int" in str(f.type)}
    assert annotated == set(INT_LIMITS)  # a new field must say its range


def test_holders_reserve_from_the_slot_table_matches_request_by_request():
    allocator, table = PageAllocator(10_000, 16), SlotTable(8, 400)
    rng = np.random.default_rng(0)
    holders = []
    for slot in range(8):
        max_new = int(rng.choice([5, 300, 6000]))
        req = _req(str(slot), int(rng.integers(1, 200)), int(rng.integers(0, max_new)), 0.0, max_new)
        req.slot, req.num_pending = slot, int(rng.integers(0, 2))
        req.pages = allocator.alloc(allocator.pages_for(req.seq_len) + int(rng.integers(0, 2)))
        req.kv_len = req.seq_len - 1
        table.admit(req, eos_ids=(2,))
        holders.append(req)
    slots = np.arange(8, dtype=np.int32)
    for ratio in (0.0, 0.098, 0.7, 1.0, 0.333):
        want = sum(reserved_pages(r, allocator, ratio, len(r.pages)) for r in holders)
        assert holders_reserved_pages(table, slots, 16, ratio) == want
