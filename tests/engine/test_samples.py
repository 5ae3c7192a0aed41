"""n samples of one prompt: prefilled once and shared through the prefix cache, seeded per
sample, returned in prompt then sample order, aborted together by the parent id."""

from __future__ import annotations

import pytest

from minijax_serve import Engine, SamplingParams
from tests.scheduler.test_chunked_prefill import TINY, prompts_and_refs  # noqa: F401
from tests.engine.test_engine import assert_idle_and_clean


@pytest.mark.parametrize("chunk", [None, 32])
def test_greedy_samples_are_identical_and_the_prompt_is_computed_once(chunk, tiny_dir,
                                                                      prompts_and_refs):
    short, long, refs = prompts_and_refs
    engine = Engine(tiny_dir["llama"], page_size=16, chunked_prefill_size=chunk,
                    **{**TINY, "max_running_requests": 4})
    prompts = [long[0], short[3]]  # 100 and 20 tokens
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True, n=4))
    assert [o.index for o in outs] == [0, 1, 2, 3] * 2
    assert [o.request_id for o in outs] == [f"{p}-{i}" for p in ("0", "1") for i in range(4)]
    assert [o.token_ids for o in outs] == [refs[len(short)]] * 4 + [refs[3]] * 4
    # every sample but the first computes only what follows the prompt's last whole page
    # before its last token (the 4 tokens past 96 and past 16): 100 + 3 * 4 + 20 + 3 * 4
    assert engine.stats()["prefill_tokens_computed"] == sum(
        len(p) + 3 * (len(p) - (len(p) - 1) // 16 * 16) for p in prompts) == 144
    assert [o.cached_tokens for o in outs] == [0, 96, 96, 96, 0, 16, 16, 16]
    assert_idle_and_clean(engine)


def test_seeded_samples_are_reproducible_and_differ(tiny_dir, tiny_prompts):
    engine = Engine(tiny_dir["llama"], page_size=16, **TINY)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, temperature=1.0, seed=7, n=3)
    first = [o.token_ids for o in engine.generate(tiny_prompts[10], params)]
    again = [o.token_ids for o in engine.generate(tiny_prompts[10], params)]
    assert first == again
    assert len({tuple(t) for t in first}) == 3
    unseeded = engine.generate(tiny_prompts[10], SamplingParams(max_new_tokens=16, ignore_eos=True,
                                                               temperature=1.0, n=3))
    assert len({tuple(o.token_ids) for o in unseeded}) == 3
    single = engine.generate(tiny_prompts[10], SamplingParams(max_new_tokens=16, ignore_eos=True,
                                                             temperature=1.0, seed=7))
    assert single[0].request_id.isdigit() and single[0].index == 0  # n = 1: the id itself
    assert single[0].token_ids == first[0]  # sample 0 draws from the seed itself
    assert_idle_and_clean(engine)


def test_samples_through_the_step_api_and_abort_by_parent(tiny_dir, tiny_prompts):
    engine = Engine(tiny_dir["llama"], page_size=16, **{**TINY, "max_running_requests": 4})
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, n=3)
    kept = engine.add_request(tiny_prompts[5], params, request_id="keep")
    gone = engine.add_request(tiny_prompts[6], params, request_id="gone")
    assert (kept, gone) == ("keep", "gone")
    with pytest.raises(ValueError, match="'keep-1' is already in use"):
        engine.add_request(tiny_prompts[7], SamplingParams(max_new_tokens=4), request_id="keep-1")
    outputs: dict[str, list] = {}
    for _ in range(3):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert engine.abort("gone")
    assert not engine.abort("gone")
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert sorted(outputs) == [f"{p}-{i}" for p in ("gone", "keep") for i in range(3)]
    assert {outputs[f"gone-{i}"][-1].finish_reason for i in range(3)} == {"abort"}
    assert len({tuple(outputs[f"keep-{i}"][-1].token_ids) for i in range(3)}) == 1
    assert engine.stats()["num_aborted"] == 3
    assert_idle_and_clean(engine)
    # an automatic parent id skips one whose sample ids a caller's request holds
    assert engine.add_request(tiny_prompts[7], SamplingParams(max_new_tokens=2), "0-1") == "0-1"
    assert engine.add_request(tiny_prompts[8], SamplingParams(max_new_tokens=2, n=2)) == "1"
    finished = set()
    while engine.has_unfinished():
        finished |= {out.request_id for out in engine.step() if out.finished}
    assert finished == {"0-1", "1-0", "1-1"}
    assert_idle_and_clean(engine)
