"""Overlap scheduling on tiny Llama models: with and without overlap every mode of the engine
gives the same outputs, and no page or slot leaks."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from minijax_serve import Engine, SamplingParams
from tests.scheduler.test_chunked_prefill import TINY, prompts_and_refs, run_arrivals  # noqa: F401
from tests.engine.test_engine import assert_idle_and_clean

NEW = 12


@pytest.fixture(scope="module")
def llama_with_tokenizer(tiny_dir, tmp_path_factory):
    """The tiny Llama with a word-level tokenizer (token i <-> "w{i}"), for stop strings."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("overlap") / "llama"
    shutil.copytree(tiny_dir["llama"], path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(301)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)
    return path


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=NEW, ignore_eos=True, **kw)


MODES = {  # name -> (engine overrides, sampling params)
    "greedy": ({}, _greedy()),
    "seeded": ({}, SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=7,
                                  ignore_eos=True)),
    "radix-off": (dict(enable_radix_cache=False), _greedy()),
    "chunked-mixed": (dict(page_size=4, chunked_prefill_size=16, enable_mixed_chunk=True), _greedy()),
    "forced-retract": (dict(force_retract_every=3), _greedy()),
    "one-token": ({}, SamplingParams(max_new_tokens=1, ignore_eos=True)),
    "stop-tokens": ({}, None),  # stop_token_ids picked from the greedy outputs
    "stop-strings": (dict(skip_tokenizer_init=False), None),
}


def _run(model, overrides: dict, params: SamplingParams, short, long, overlap: bool):
    engine = Engine(model, **{**TINY, **overrides}, enable_overlap=overlap)
    outs = run_arrivals(engine, short, long, params)
    assert_idle_and_clean(engine)
    return engine, [(o.token_ids, o.finish_reason, o.text) for o in outs]


@pytest.mark.parametrize("mode", list(MODES))
def test_overlap_on_and_off_give_the_same_outputs(mode, tiny_dir, llama_with_tokenizer,
                                                  prompts_and_refs):
    short, long, refs = prompts_and_refs
    overrides, params = MODES[mode]
    model = llama_with_tokenizer if mode == "stop-strings" else tiny_dir["llama"]
    if mode == "stop-tokens":  # tokens the greedy outputs meet mid-way: early finishes
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True,
                                stop_token_ids=[refs[0][3], refs[5][5], refs[7][2]])
    if mode == "stop-strings":  # the text of two consecutive greedy tokens of some outputs
        params = SamplingParams(max_new_tokens=NEW, ignore_eos=True,
                                stop=[f"w{refs[1][4]} w{refs[1][5]}", f"w{refs[6][2]} w{refs[6][3]}"])
    on_engine, on = _run(model, overrides, params, short, long, overlap=True)
    off_engine, off = _run(model, overrides, params, short, long, overlap=False)
    assert on == off
    if mode in ("greedy", "chunked-mixed"):  # the latter: unified steps
        assert [tokens for tokens, _, _ in on] == refs
    if mode.startswith("stop"):
        assert sum(reason == "stop" for _, reason, _ in on) >= 2
    if mode == "forced-retract":
        assert on_engine.stats()["num_retracted"] > 0 and off_engine.stats()["num_retracted"] > 0


def test_outputs_trail_the_device_by_one_step(tiny_dir):
    engine = Engine(tiny_dir["llama"], **TINY)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert engine.step() == []  # the prefill is dispatched; its token is taken next tick
    lengths = []
    while engine.has_unfinished():
        lengths += [len(o.token_ids) for o in engine.step() if o.request_id == rid]
    assert lengths == [1, 2, 3]
    stats = engine.stats()
    assert stats["host_time_s"] > 0 and stats["blocked_time_s"] >= 0
    assert 0 <= stats["device_idle_fraction"] <= 1
    assert stats["mean_host_ms_per_step"] > 0
    assert_idle_and_clean(engine)


def test_without_overlap_each_step_returns_its_tokens(tiny_dir):
    engine = Engine(tiny_dir["llama"], **TINY, enable_overlap=False)
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
    assert [len(o.token_ids) for o in engine.step()] == [1]
    assert [len(o.token_ids) for o in engine.step()] == [2]
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats["device_idle_fraction"] == pytest.approx(
        stats["host_time_s"] / (stats["host_time_s"] + stats["blocked_time_s"]), rel=0.05)


def test_requests_finishing_while_a_step_is_in_flight_free_everything(tiny_dir):
    """Many short requests with a long queue: each finishes while its next step is in flight."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 250, size=int(n)).tolist() for n in rng.integers(2, 30, size=24)]
    params = [SamplingParams(max_new_tokens=int(n), ignore_eos=True) for n in rng.integers(1, 6, size=24)]
    results = []
    for overlap in (True, False):
        engine = Engine(tiny_dir["llama"], **{**TINY, "max_total_tokens": 256, "page_size": 4},
                        enable_overlap=overlap)
        results.append([o.token_ids for o in engine.generate(prompts, params)])
        assert_idle_and_clean(engine)
    assert results[0] == results[1]
    assert [len(r) for r in results[0]] == [p.max_new_tokens for p in params]


def test_a_decoder_short_of_a_page_waits_for_a_finishing_request_in_flight(tiny_dir):
    """Pool of 5 pages of 4 tokens, nothing evictable. A (7-token prompt, 5 new tokens) and B
    (4-token prompt, 16 new tokens) are admitted together (ratio 0.1; admitted by their exact
    future, B would wait for A). When A's last token is in flight, A may not decode but still
    holds its 3 pages, the pool is empty and B needs a page: retracting B would not help, so the
    step waits for A's result to free its pages."""
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15]]
    params = [SamplingParams(max_new_tokens=5, ignore_eos=True),
              SamplingParams(max_new_tokens=16, ignore_eos=True)]
    config = {**TINY, "page_size": 4, "max_total_tokens": 20, "enable_radix_cache": False,
              "init_new_token_ratio": 0.1, "chunked_prefill_size": -1,
              "exact_ignore_eos_admission": False}
    results = []
    for overlap in (True, False):
        engine = Engine(tiny_dir["llama"], **config, enable_overlap=overlap)
        results.append([o.token_ids for o in engine.generate(prompts, params)])
        assert engine.stats()["num_retracted"] == 0
        assert engine.stats()["prefill_steps"] == 1  # admitted together
        assert_idle_and_clean(engine)
    assert results[0] == results[1]
    assert [len(r) for r in results[0]] == [5, 16]
