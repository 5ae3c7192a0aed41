"""Engine core on tiny random models: continuous batching against HF transformers, batch
invariance, ledgers, donation, compilation counts and bad input."""

from __future__ import annotations

import numpy as np
import pytest

from minijax_serve import Engine, SamplingParams
from tests import hf_reference
from tests.conftest import FAMILIES

# Small bucket sets keep compilations few: prompts <= 40 tokens, outputs 24, context 128.
# XLA CPU's default (MLIR) fusion emitters, for a check of a program as an engine compiles it
DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True}
TINY = dict(skip_tokenizer_init=True, max_total_tokens=1024, max_running_requests=4,
            max_prefill_tokens=64, min_token_bucket=64, min_kv_bucket=128)
GREEDY24 = SamplingParams(max_new_tokens=24, ignore_eos=True)


def assert_idle_and_clean(engine: Engine) -> None:
    """At idle every KV page is free or an evictable prefix-cache page, and every slot is free."""
    engine.check_invariants()
    cached_pages = engine.prefix_cache.evictable_size // engine.allocator.page_size
    assert engine.prefix_cache.protected_size == 0
    assert engine.allocator.num_free + cached_pages == engine.allocator.total_pages
    assert engine.slots.num_free == engine.slots.num_slots
    assert not engine.has_unfinished()


@pytest.fixture(scope="module")
def tiny_engine(tiny_dir):
    """One engine per (family, page size), shared by the tests of this module; those of page
    size 1 run unified steps (the accelerators' default), those of 16 prefill and decode steps
    apart (the CPU's)."""
    engines = {}

    def get(family: str, page_size: int = 16) -> Engine:
        if (family, page_size) not in engines:
            engines[family, page_size] = Engine(tiny_dir[family], page_size=page_size,
                                                enable_mixed_chunk=page_size == 1, **TINY)
        return engines[family, page_size]

    return get


@pytest.fixture
def llama_engine(tiny_engine):
    return tiny_engine("llama")


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("family", FAMILIES)
def test_continuous_batching_matches_hf(family, page_size, tiny_engine, tiny_prompts,
                                        tiny_greedy_refs):
    # max_running_requests=4 < 16 prompts: requests queue and join the running batch mid-flight
    engine = tiny_engine(family, page_size)
    before = engine.stats()
    outs = engine.generate(tiny_prompts, GREEDY24)
    for out, ref, prompt in zip(outs, tiny_greedy_refs[family], tiny_prompts):
        assert out.token_ids == ref
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == "length"
    stats = {k: v - before[k] for k, v in engine.stats().items()}
    # requests joined mid-flight, with unified steps riding along with the decoders
    assert stats["prefill_steps"] + stats["mixed_steps"] > 1 and stats["decode_steps"] > 24
    assert (stats["mixed_steps"] > 0) == (page_size == 1)
    assert stats["generated_tokens"] == 16 * 24
    # the prefix cache serves what it can (page_size 1: prompts sharing a first token)
    assert stats["prompt_tokens"] == sum(map(len, tiny_prompts))
    assert stats["prefill_tokens_computed"] + stats["cached_tokens"] == stats["prompt_tokens"]
    assert 0 < engine.stats()["peak_kv_tokens_used"] <= engine.stats()["kv_pool_tokens"]
    assert_idle_and_clean(engine)


def test_batch_invariance_greedy_and_seeded(llama_engine, tiny_prompts):
    target = tiny_prompts[9]
    others = [p for i, p in enumerate(tiny_prompts) if i != 9]
    for params in (GREEDY24, SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9,
                                            seed=7, ignore_eos=True)):
        alone = llama_engine.generate([target], params)[0].token_ids
        batch = llama_engine.generate(others[:8] + [target] + others[8:], params)[8].token_ids
        assert alone == batch
        assert_idle_and_clean(llama_engine)
    sampled = llama_engine.generate([target] * 3, [SamplingParams(max_new_tokens=24, temperature=1.0,
                                                                  seed=s, ignore_eos=True)
                                                   for s in (1, 1, 2)])
    assert sampled[0].token_ids == sampled[1].token_ids != sampled[2].token_ids
    assert_idle_and_clean(llama_engine)


def test_top_k_one_equals_greedy_and_above_the_vocabulary_is_off(llama_engine, tiny_prompts):
    greedy = llama_engine.generate(tiny_prompts[:6], GREEDY24)
    topk1 = llama_engine.generate(tiny_prompts[:6], SamplingParams(
        max_new_tokens=24, temperature=0.7, top_k=1, ignore_eos=True))
    assert [o.token_ids for o in greedy] == [o.token_ids for o in topk1]
    off, above = (llama_engine.generate(tiny_prompts[:6], SamplingParams(
        max_new_tokens=24, temperature=0.7, top_k=k, seed=5, ignore_eos=True))
        for k in (-1, 2**31 - 1))  # the largest top_k an int32 row holds; the vocabulary is 301
    assert [o.token_ids for o in off] == [o.token_ids for o in above]
    assert_idle_and_clean(llama_engine)


def test_stop_token_ids_and_min_new_tokens(llama_engine, tiny_prompts, tiny_greedy_refs):
    ref = tiny_greedy_refs["llama"][5]
    stop_at = ref[3]
    first = ref.index(stop_at)
    out = llama_engine.generate([tiny_prompts[5]], SamplingParams(
        max_new_tokens=24, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:first + 1]
    # min_new_tokens masks the stop token until reached: the output differs from the reference
    masked = llama_engine.generate([tiny_prompts[5]], SamplingParams(
        max_new_tokens=24, min_new_tokens=first + 2, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert stop_at not in masked.token_ids[:first + 1]
    assert len(masked.token_ids) >= first + 2
    assert_idle_and_clean(llama_engine)


def test_timestamps_and_step_api(llama_engine, tiny_prompts):
    rids = [llama_engine.add_request(p, SamplingParams(max_new_tokens=5, ignore_eos=True))
            for p in tiny_prompts[:6]]
    seen: dict[str, list] = {r: [] for r in rids}
    while llama_engine.has_unfinished():
        for out in llama_engine.step():
            seen[out.request_id].append(out)
    for rid in rids:
        final = seen[rid][-1]
        assert final.finished and len(final.token_ids) == 5
        assert [len(o.token_ids) for o in seen[rid]] == [1, 2, 3, 4, 5]
        assert final.arrival_time <= final.first_token_time <= final.finish_time
        assert final.token_times == sorted(final.token_times) and len(final.token_times) == 5
    assert_idle_and_clean(llama_engine)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_kv_pools_are_donated_not_copied(backend, tiny_dir, tiny_prompts):
    engine = Engine(tiny_dir["llama"], page_size=16, attention_backend=backend,
                    **{**TINY, "max_total_tokens": 65536})
    runner = engine.runner
    k_before, v_before, buf_before = runner.k_pool, runner.v_pool, runner.token_buf
    engine.add_request(tiny_prompts[3], SamplingParams(max_new_tokens=3, ignore_eos=True))
    engine.step()
    assert k_before.is_deleted() and v_before.is_deleted() and buf_before.is_deleted()
    while engine.has_unfinished():
        engine.step()
    # inside the step: the pools ride the layer scan as carry, updated in place. Checked on the
    # program as XLA compiles it by default: the suite's cheaper emitters (conftest) copy a
    # pool around the interpret-mode kernel's in-place update on the CPU
    for shape in runner.step_shapes:
        program = runner._step_lowering(shape)().compile(DEFAULT_EMITTERS)
        temp = program.memory_analysis().temp_size_in_bytes
        assert temp < runner.k_pool.nbytes / 4, (shape, temp, runner.k_pool.nbytes)
    assert_idle_and_clean(engine)


def test_compilations_bounded_by_buckets_used(tiny_dir, monkeypatch):
    engine = Engine(tiny_dir["qwen2"], page_size=16, **TINY)
    used = set()
    run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run",
                        lambda fb, shape, *rest: (used.add(shape), run(fb, shape, *rest))[1])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, size=rng.integers(1, 60)).tolist() for _ in range(64)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(1, 30)), ignore_eos=True,
                             temperature=float(rng.choice([0.0, 0.9])), seed=i)
              for i in range(64)]
    outs = engine.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_new_tokens for p in params]
    assert engine.runner.step_shapes == used
    assert_idle_and_clean(engine)


def test_warmup_then_timed_run_compiles_nothing(tiny_dir, tiny_prompts):
    engine = Engine(tiny_dir["mistral"], page_size=16, **TINY)
    n = engine.warmup()
    assert n == engine.stats()["num_compilations"]
    assert engine.runner.step_shapes == set(engine.buckets.all_shapes())
    num_seqs = {s.num_seqs for s in engine.buckets.all_shapes()}
    # per number of sequences: 6 samplers (greedy, sampled with a sort for top-k / top-p /
    # min-p or without; penalised or not) and the logprobs
    assert n == len(engine.buckets.all_shapes()) + 7 * len(num_seqs) + 2  # + the row writers
    engine.generate(tiny_prompts, [SamplingParams(max_new_tokens=10, temperature=0.5, seed=1,
                                                  ignore_eos=True)] * 16)
    assert engine.stats()["num_compilations"] == n
    assert_idle_and_clean(engine)


OK8 = SamplingParams(max_new_tokens=8)
BAD_INPUTS = [  # (prompt, sampling params, message): rejected by the engine before queueing
    ([], OK8, r"prompts\[1\] is empty"),
    ([1, 2, 999], OK8, r"prompts\[1\]\[2\]: token id 999 is outside the vocabulary \[0, 301\)"),
    ([-1], OK8, "outside the vocabulary"),
    ("text", OK8, r"prompts\[1\]: text prompts need a tokenizer"),
    (3.5, OK8, r"prompts\[1\] must be a str or a list of token ids, got float"),
    ([1.5, 2], OK8, r"prompts\[1\]\[0\] must be a token id \(an int\), got 1.5"),
    ([1, "a", 3], OK8, r"prompts\[1\]\[1\] must be a token id \(an int\), got 'a'"),
    ([1, 2], "greedy", "sampling_params must be SamplingParams"),
    ([1] * 100, SamplingParams(max_new_tokens=29), r"exceeds the context length \(128 tokens\)"),
    ([1, 2], SamplingParams(max_new_tokens=8, stop_token_ids=[100000]),
     r"stop_token_ids must be in \[0, 301\), got 100000"),
    ([1, 2], SamplingParams(max_new_tokens=8, stop=["x"]), "stop strings need a tokenizer"),
    ([1, 2], SamplingParams(max_new_tokens=8, n=5), r"n must be <= max_running_requests=4, got 5"),
]


@pytest.mark.parametrize("prompt,params,message", BAD_INPUTS)
def test_bad_input_is_rejected_and_engine_keeps_serving(llama_engine, tiny_prompts,
                                                        tiny_greedy_refs, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llama_engine.generate([tiny_prompts[2], prompt], params)  # nothing of it is queued
    assert not llama_engine.has_unfinished()
    with pytest.raises(ValueError, match=message.replace(r"prompts\[1\]", "prompt")):
        llama_engine.add_request(prompt, params)
    out = llama_engine.generate([tiny_prompts[2]], GREEDY24)[0]
    assert out.token_ids == tiny_greedy_refs["llama"][2]
    assert_idle_and_clean(llama_engine)


@pytest.mark.parametrize("params,message", [
    (SamplingParams(max_new_tokens=8, stop_token_ids=[100000]),
     r"^prompts\[1\]: stop_token_ids must be in \[0, 301\), got 100000$"),
    (SamplingParams(max_new_tokens=8, logit_bias={400: 1.0}),
     r"^prompts\[1\]: logit_bias: token ids must be in \[0, 301\), got 400$"),
    (SamplingParams(max_new_tokens=8, regex="a+"), r"^prompts\[1\]: regex: "),  # no tokenizer
])
def test_errors_of_one_prompts_own_params_name_the_prompt(llama_engine, tiny_prompts, params,
                                                         message):
    with pytest.raises(ValueError, match=message):
        llama_engine.generate([tiny_prompts[2], [1, 2]], [OK8, params])
    assert not llama_engine.has_unfinished()
    with pytest.raises(ValueError, match=message.replace(r"^prompts\[1\]: ", "^")):
        llama_engine.generate([tiny_prompts[2], [1, 2]], params)  # shared: no prompt of its own
    assert_idle_and_clean(llama_engine)


def test_max_logprobs_bounds_the_logprobs_a_request_may_ask(tiny_dir):
    engine = Engine(tiny_dir["llama"], page_size=16, **{**TINY, "max_logprobs": 3})
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} must be <= max_logprobs=3, got 4"):
            engine.add_request([1, 2], SamplingParams(max_new_tokens=8, **{field: 4}))
    assert len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2, logprobs=3))[0].logprobs[0]) >= 3
    assert_idle_and_clean(engine)


def test_request_larger_than_pool_is_rejected(tiny_dir):
    engine = Engine(tiny_dir["llama"], page_size=16, **{**TINY, "max_total_tokens": 48})
    with pytest.raises(ValueError, match="exceeds the KV pool"):
        engine.add_request([1] * 40, SamplingParams(max_new_tokens=20))
    out = engine.generate([[1] * 20], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    assert len(out.token_ids) == 20
    assert_idle_and_clean(engine)


def test_small_pool_admits_only_what_fits(tiny_dir, tiny_prompts, tiny_greedy_refs):
    # 6 pages of 16 tokens; each request reserves its prompt + all 24 new tokens (2 to 4 pages)
    engine = Engine(tiny_dir["llama"], page_size=16, **{**TINY, "max_total_tokens": 96})
    seen_running = []
    tick = engine._tick

    def counting_tick():
        seen_running.append(len(engine.scheduler.running))
        return tick()

    engine._tick = counting_tick
    outs = engine.generate(tiny_prompts, GREEDY24)
    assert [o.token_ids for o in outs] == tiny_greedy_refs["llama"]
    assert max(seen_running) < 4  # the pool, not max_running_requests=4, bounded the batch
    assert engine.stats()["peak_kv_tokens_used"] <= 96
    assert_idle_and_clean(engine)


def test_prompt_longer_than_prefill_budget_runs_alone(llama_engine, tiny_dir):
    long_prompt = (np.arange(100) * 7 % 250).tolist()  # > max_prefill_tokens=64
    ref = hf_reference.greedy(tiny_dir["llama"], [long_prompt], 20)[0]
    before = llama_engine.stats()["prefill_steps"]
    outs = llama_engine.generate([[5, 6, 7], long_prompt, [8, 9]], SamplingParams(
        max_new_tokens=20, ignore_eos=True))
    assert outs[1].token_ids == ref
    assert llama_engine.stats()["prefill_steps"] - before == 3  # short, long alone, short
    assert_idle_and_clean(llama_engine)
