"""Logprobs and prompt logprobs against HuggingFace's teacher-forced float32 log-softmax, in
plain decode, chunked + mixed steps, after retracts and with overlap on and off; requests that
ask for none keep their tokens and compile nothing new."""

from __future__ import annotations

import pytest

from minijax_serve import Engine, SamplingParams
from tests import hf_reference
from tests.scheduler.test_chunked_prefill import TINY, prompts_and_refs  # noqa: F401
from tests.engine.test_engine import assert_idle_and_clean
from tests.models.test_smollm2 import CHAT, TEXTS

K = 5
MODES = {
    "plain": {},
    "no-overlap": dict(enable_overlap=False),
    "chunked-mixed": dict(chunked_prefill_size=32, enable_mixed_chunk=True),
    "forced-retract": dict(chunked_prefill_size=32, force_retract_every=3),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_logprobs_match_hf_teacher_forced(mode, tiny_dir, hf_llama, prompts_and_refs):
    short, long, refs = prompts_and_refs
    prompts = short + long
    engine = Engine(tiny_dir["llama"], page_size=16, **TINY, **MODES[mode])
    if mode == "plain":
        engine.warmup()
    compiled = engine.stats()["num_compilations"]
    asks = [i % 2 == 0 for i in range(len(prompts))]  # half ask for logprobs, in the same batches
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=K if a else None)
              for a in asks]
    if mode == "plain":  # streamed: the deltas' logprobs concatenate to the final ones
        per_request: dict[str, list] = {}
        for out in engine.stream(prompts, params):
            per_request.setdefault(out.request_id, []).append(out)
        outs = [o[-1] for o in per_request.values()]
        for o, ask in zip(per_request.values(), asks):
            if ask:
                assert [lp for x in o for lp in x.new_logprobs] == o[-1].logprobs
        assert engine.stats()["num_compilations"] == compiled  # warmup compiled every program
    else:
        outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == refs
    for out, prompt, ask in zip(outs, prompts, asks):
        if not ask:
            assert out.logprobs is None
            continue
        ref = hf_reference.log_softmax_rows(hf_llama, prompt + out.token_ids, len(prompt))
        hf_reference.assert_logprobs_match(out.logprobs, out.token_ids, ref, K)
    if mode == "forced-retract":
        assert engine.stats()["num_retracted"] > 0
    if mode == "chunked-mixed":
        assert engine.stats()["mixed_steps"] > 0
    assert_idle_and_clean(engine)


def test_logprobs_zero_and_max(tiny_dir, tiny_prompts, hf_llama):
    engine = Engine(tiny_dir["llama"], page_size=16, **TINY)
    zero, top20 = engine.generate([tiny_prompts[8]] * 2, [
        SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=k) for k in (0, 20)])
    assert all(len(lp) == 1 for lp in zero.logprobs)
    assert all(len(lp) in (20, 21) for lp in top20.logprobs)
    ref = hf_reference.log_softmax_rows(hf_llama, tiny_prompts[8] + zero.token_ids, len(tiny_prompts[8]))
    hf_reference.assert_logprobs_match(zero.logprobs, zero.token_ids, ref, 0)
    hf_reference.assert_logprobs_match(top20.logprobs, top20.token_ids, ref, 20)
    assert_idle_and_clean(engine)


@pytest.mark.parametrize("overrides", [dict(chunked_prefill_size=32),
                                       dict(enable_overlap=False, force_retract_every=2)])
def test_prompt_logprobs_match_hf(overrides, tiny_dir, hf_llama, prompts_and_refs):
    """Every prompt token after the first, chunked or not, even when the prompt is cached (such
    a request computes its whole prompt); a retract later does not score the prompt again."""
    short, long, refs = prompts_and_refs
    engine = Engine(tiny_dir["llama"], page_size=16, **TINY, **overrides)
    prompts = [long[0], short[3], long[2]]
    engine.generate(prompts, SamplingParams(max_new_tokens=2))  # now their prompts are cached
    before = engine.stats()["prefill_tokens_computed"]
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True, prompt_logprobs=3),
              SamplingParams(max_new_tokens=12, ignore_eos=True, prompt_logprobs=0),
              SamplingParams(max_new_tokens=12, ignore_eos=True)]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [refs[len(short)], refs[3], refs[len(short) + 2]]
    assert engine.stats()["prefill_tokens_computed"] - before >= len(prompts[0]) + len(prompts[1])
    for out, prompt, p in zip(outs[:2], prompts, params):
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        ref = hf_reference.log_softmax_rows(hf_llama, prompt, 1)
        # a random prompt's tokens can be very unlikely (logprob ~ -30): float32 noise there
        # is relative, ~1e-5 of the value
        hf_reference.assert_logprobs_match(lps[1:], prompt[1:], ref, p.prompt_logprobs)
    assert outs[2].prompt_logprobs is None
    if "force_retract_every" in overrides:
        assert engine.stats()["num_retracted"] > 0
    assert_idle_and_clean(engine)


def test_smollm2_logprobs_match_hf(smollm2_engine, hf_smollm2):
    tok = smollm2_engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       tokenize=False) for c in CHAT[:2]] + TEXTS[:2]
    ids = [tok.encode(p) for p in prompts]
    refs = hf_reference.greedy(None, ids, 16, model=hf_smollm2)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=K, prompt_logprobs=2)
    outs = smollm2_engine.generate(ids, [params, SamplingParams(max_new_tokens=16, ignore_eos=True)] * 2)
    assert [o.token_ids for o in outs] == refs
    for out, prompt in zip(outs[::2], ids[::2]):
        ref = hf_reference.log_softmax_rows(hf_smollm2, prompt + out.token_ids, len(prompt))
        hf_reference.assert_logprobs_match(out.logprobs, out.token_ids, ref, K)
        ref = hf_reference.log_softmax_rows(hf_smollm2, prompt, 1)
        hf_reference.assert_logprobs_match(out.prompt_logprobs[1:], prompt[1:], ref, 2)
    assert_idle_and_clean(smollm2_engine)
