"""RadixAttention in the engine: shared-prefix workloads against HuggingFace transformers with the
prefix cache on and off, a random prefix tree under eviction for each cache-aware policy, the
flush_cache, policy orders and config validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from minijax_serve import Engine, EngineConfig, SamplingParams
from minijax_serve.core.request import Req
from minijax_serve.memory import PageAllocator, RadixCache
from minijax_serve.scheduler.policy import SchedulePolicy
from tests import hf_reference
from tests.engine.test_engine import assert_idle_and_clean

# test_engine's tiny buckets; max_prefill_tokens=128 adds no bucket (the context is 128) and lets
# several prompts of a round share one prefill step, and with it the pages one of them computes.
TINY = dict(skip_tokenizer_init=True, max_total_tokens=1024, max_running_requests=4,
            max_prefill_tokens=128, min_token_bucket=64, min_kv_bucket=128)
NEW = 6
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
SYSTEM_LEN, NUM_QUESTIONS = 40, 6


@pytest.fixture(scope="module")
def shared_rounds(hf_llama):
    """Rounds of prompts, each submitted in one generate call once the previous round finished,
    and the HF greedy continuation of every prompt (by token tuple)."""
    rng = np.random.default_rng(5)
    tokens = lambda n: rng.integers(0, 250, size=n).tolist()  # noqa: E731
    refs: dict[tuple[int, ...], list[int]] = {}

    def ref(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in refs:
            refs[tuple(prompt)] = hf_reference.greedy(None, [prompt], NEW, model=hf_llama)[0]
        return refs[tuple(prompt)]

    system = tokens(SYSTEM_LEN)
    firsts = rng.choice(250, NUM_QUESTIONS, replace=False)  # questions differ from their first token
    rounds = [[system + [int(f)] + tokens(int(rng.integers(2, 9))) for f in firsts]]
    # two multi-turn conversations with one system prompt: turn n+1 = turn n + its output + more
    chat_system = tokens(36)
    turns = [chat_system + tokens(6), chat_system + tokens(6)]
    rounds.append(turns)
    for more in (7, 9, 10):
        turns = [t + ref(t) + tokens(more) for t in turns]
        rounds.append(turns)
    dup, long = tokens(50), tokens(60)
    rounds += [[dup, dup, dup], [dup, long], [long[:25], long + tokens(10)]]
    x = tokens(40)
    rounds.append([x, x + tokens(15)])  # a prompt and its extension in the same round
    for prompts in rounds:
        for p in prompts:
            ref(p)
    return rounds, refs


@pytest.fixture(scope="module")
def llama_engine(tiny_dir):
    """One engine per (page size, radix cache on), shared by the tests of this module."""
    engines: dict[tuple[int, bool], Engine] = {}

    def get(page_size: int, radix: bool) -> Engine:
        if (page_size, radix) not in engines:
            engines[page_size, radix] = Engine(tiny_dir["llama"], page_size=page_size,
                                               enable_radix_cache=radix, **TINY)
        return engines[page_size, radix]

    return get


def run_rounds(engine: Engine, rounds, refs) -> list[dict[str, float]]:
    """Run every round, check its outputs against HF; returns each round's stats deltas."""
    deltas = []
    for prompts in rounds:
        before = engine.stats()
        outs = engine.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == [refs[tuple(p)] for p in prompts]
        deltas.append({k: v - before[k] for k, v in engine.stats().items()})
        assert_idle_and_clean(engine)
    return deltas


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefixes_match_hf_with_cache_on_and_off(page_size, llama_engine, shared_rounds):
    rounds, refs = shared_rounds
    engine = llama_engine(page_size, radix=True)
    engine.flush_cache()
    on = run_rounds(engine, rounds, refs)
    off = run_rounds(llama_engine(page_size, radix=False), rounds, refs)
    for r_on, r_off, prompts in zip(on, off, rounds):
        assert r_on["cached_tokens"] > 0  # every round shares a prefix with itself or the past
        assert r_on["prefill_tokens_computed"] + r_on["cached_tokens"] == r_on["prompt_tokens"]
        assert r_on["prefill_tokens_computed"] < r_off["prefill_tokens_computed"]
        assert r_off["cached_tokens"] == 0
        assert r_off["prefill_tokens_computed"] == r_off["prompt_tokens"] == sum(map(len, prompts))
    # first round, on a flushed cache, in one step: the first prompt computes the system
    # prompt, the others borrow its whole pages in the same step
    assert on[0]["cached_tokens"] == (NUM_QUESTIONS - 1) * (SYSTEM_LEN // page_size * page_size)
    assert 0 < engine.stats()["cache_hit_rate"] < 1
    assert engine.stats()["evicted_tokens"] == 0  # the pool was large enough


def tree_prompts(seed: int, num_nodes: int = 220, max_len: int = 96) -> list[list[int]]:
    """Every root-to-node path of a random tree whose edges are random token segments."""
    rng = np.random.default_rng(seed)
    prompts: list[list[int]] = []
    while len(prompts) < num_nodes:
        parent = int(rng.integers(-1, len(prompts)))  # -1: a child of the root
        segment = rng.integers(0, 250, size=int(rng.integers(1, 9))).tolist()
        base = prompts[parent] if parent >= 0 else []
        if len(base) + len(segment) <= max_len:
            prompts.append(base + segment)
    order = rng.permutation(num_nodes)
    return [prompts[i] for i in order]


@pytest.fixture(scope="module")
def tree_workload(tiny_dir, hf_llama):
    prompts = tree_prompts(seed=0)
    return prompts, hf_reference.greedy(None, prompts, 4, model=hf_llama)


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_random_prefix_tree_under_eviction_matches_hf(policy, tiny_dir, tree_workload):
    prompts, refs = tree_workload
    # 64 pages of 4 tokens for ~1000 distinct tree tokens: the cache must evict to admit. Every
    # request's whole max_new_tokens is reserved (no over-commit, so no retract and its
    # re-prefills): each prompt token is computed or cached exactly once
    engine = Engine(tiny_dir["llama"], page_size=4, schedule_policy=policy,
                    init_new_token_ratio=1.0, min_new_token_ratio_factor=1.0,
                    **{**TINY, "max_total_tokens": 256, "max_running_requests": 16})
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs  # each prompt as HF generates it alone
    stats = engine.stats()
    assert stats["evicted_tokens"] > 0 and stats["cached_tokens"] > 0
    assert stats["num_retracted"] == 0
    assert stats["prefill_tokens_computed"] + stats["cached_tokens"] == sum(map(len, prompts))
    assert sum(o.cached_tokens for o in outs) == stats["cached_tokens"]
    assert_idle_and_clean(engine)
    engine.flush_cache()
    assert engine.allocator.num_free == engine.allocator.total_pages


def test_flush_cache_frees_every_page_and_refuses_while_busy(llama_engine):
    engine = llama_engine(16, radix=True)
    prompt = list(range(3, 60))
    engine.generate([prompt], GREEDY)
    assert engine.prefix_cache.evictable_size > 0
    engine.add_request(prompt, GREEDY)
    with pytest.raises(RuntimeError, match="1 waiting, 0 running"):
        engine.flush_cache()
    engine.step()
    with pytest.raises(RuntimeError, match="0 waiting, 1 running"):
        engine.flush_cache()
    while engine.has_unfinished():
        engine.step()
    engine.flush_cache()
    assert engine.allocator.num_free == engine.allocator.total_pages
    assert engine.prefix_cache.evictable_size == engine.prefix_cache.protected_size == 0
    engine.check_invariants()


def test_cache_unfinished_shares_a_running_prefix():
    alloc = PageAllocator(32, 4)
    cache = RadixCache(alloc)
    tokens = list(range(10))  # two whole pages and a partial one
    first = alloc.alloc(3)
    m = cache.cache_unfinished(tokens, first)
    assert (m.length, m.pages) == (8, first[:2])
    cache.lock(m.node)
    # a second request computed the same tokens meanwhile: its whole pages are duplicates
    second = alloc.alloc(3)
    free_before = alloc.num_free
    m2 = cache.cache_unfinished(tokens, second)
    assert (m2.length, m2.pages, m2.node) == (8, first[:2], m.node)
    assert alloc.num_free == free_before + 2  # second[:2] freed; second[2] (partial) kept
    cache.lock(m2.node)
    assert cache.protected_size == 8 and cache.evictable_size == 0
    cache.check_invariants()


def make_req(rid: str, prompt: list[int], max_new_tokens: int = 8) -> Req:
    return Req(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens), 0, 0.0)


def test_policy_orders():
    alloc = PageAllocator(64, 1)
    cache = RadixCache(alloc)
    for tokens in ([1, 2, 3, 4], [5, 6, 7, 8, 9]):
        cache.cache_finished(tokens, alloc.alloc(len(tokens)))
    waiting = [make_req("none", [9, 9], 4), make_req("a2", [1, 2, 0], 16), make_req("b1", [5, 6, 0]),
               make_req("a4", [1, 2, 3, 4, 0], 2), make_req("b4", [5, 6, 7, 8, 0]),
               make_req("b5", [5, 6, 7, 8, 9, 0])]
    order = lambda name, **kw: [r.rid for r in SchedulePolicy(  # noqa: E731
        name, cache, lpm_max_queue=kw.get("lpm_max_queue", 128), seed=0).order(waiting).reqs]
    assert order("fcfs") == ["none", "a2", "b1", "a4", "b4", "b5"]
    assert order("lpm") == ["b5", "a4", "b4", "a2", "b1", "none"]  # ties keep arrival order
    assert order("lpm", lpm_max_queue=5) == order("fcfs")  # 6 waiting > 5: fcfs
    assert order("lof") == ["a2", "b1", "b4", "b5", "none", "a4"]
    # b's subtree holds 3 waiting requests, a's 2; a node's own requests before its children
    assert order("dfs-weight") == ["none", "b1", "b4", "b5", "a2", "a4"]
    shuffled = order("random")
    assert sorted(shuffled) == sorted(order("fcfs")) and shuffled == order("random")


@pytest.mark.parametrize("field,value,message", [
    ("schedule_policy", "lru", "schedule_policy must be one of fcfs, lpm, dfs-weight, lof, random"),
    ("lpm_max_queue", 0, "lpm_max_queue must be an integer >= 1"),
    ("enable_radix_cache", "yes", "enable_radix_cache must be True or False"),
])
def test_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(EngineConfig(), **{field: value})
