"""Speculative decoding in the engine, on tiny Llama models: greedy tokens identical to
HuggingFace in every scheduler mode (overlap on and off, radix cache on and off, chunked and
mixed prefill, page sizes 1 and 16, forced retracts) with n-gram and draft-model proposals;
seeded samples token-identical to the plain sampler's with n-gram drafts and repeated with a
draft model's; stop tokens, stop strings, max_new_tokens, logprobs and streaming inside runs of
accepted tokens; requests that do not speculate riding along; the step trace; bad
configurations refused; no page or slot leaked."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from minijax_serve import Engine, EngineConfig, SamplingParams
from tests import hf_reference
from tests.engine.test_engine import assert_idle_and_clean
from tests.engine.test_overlap import llama_with_tokenizer  # noqa: F401
from tests.scheduler.test_chunked_prefill import (GREEDY, NEW, TINY, prompts_and_refs,  # noqa: F401
                                                  run_arrivals)


@pytest.fixture(scope="module")
def draft_llama(tiny_dir, tmp_path_factory):
    """The tiny Llama with every weight moved by 2 % of its spread: a draft model of the same
    vocabulary whose greedy tokens are the target's about half the time."""
    import torch

    model = hf_reference.load_hf(tiny_dir["llama"])
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * p.std() * torch.randn_like(p))
    path = tmp_path_factory.mktemp("draft_llama")
    model.save_pretrained(path)
    return path


# name -> engine overrides (each engine built once, see `engine`)
MODES = {
    "ngram": dict(speculative_method="ngram", record_steps=True),
    "ngram-page1-chunked-no-overlap-no-radix": dict(
        speculative_method="ngram", page_size=1,
        chunked_prefill_size=16, enable_overlap=False, enable_radix_cache=False),
    "draft-chunked-mixed": dict(speculative_method="draft", page_size=16,
                                chunked_prefill_size=16, enable_mixed_chunk=True),
    "self-draft-one-layer-page1-retract-no-overlap-no-radix": dict(
        speculative_method="draft", speculative_draft_layers=1, page_size=1,
        chunked_prefill_size=16, force_retract_every=3, enable_overlap=False,
        enable_radix_cache=False, num_speculative_tokens=3, record_steps=True),
}


@pytest.fixture(scope="module")
def engine(tiny_dir, draft_llama):
    engines: dict[str, Engine] = {}

    def get(mode: str) -> Engine:
        if mode not in engines:
            overrides = dict(MODES.get(mode, {}))
            if overrides.get("speculative_method") == "draft" and "layers" not in mode:
                overrides["speculative_draft_model"] = str(draft_llama)
            engines[mode] = Engine(tiny_dir["llama"], **{**TINY, **overrides})
        return engines[mode]

    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf_in_every_mode(mode, engine, prompts_and_refs):
    short, long, refs = prompts_and_refs
    e = engine(mode)
    before = e.stats()
    outs = run_arrivals(e, short, long)
    assert [o.token_ids for o in outs] == refs
    stats = e.stats()
    proposed = stats["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert proposed > 0
    if "draft" in mode:  # both verdicts met, several tokens per step on average
        assert 0 < accepted < proposed and stats["tokens_per_step"] > 1
    if e.config.force_retract_every:
        assert stats["num_retracted"] > 0
    if e.config.record_steps:
        records = e.step_records()
        assert sum(r.draft_tokens for r in records) == proposed
        assert sum(r.accepted_tokens for r in records) == accepted
        assert all(r.decode_tokens == r.decode_reqs + r.draft_tokens for r in records)
    assert_idle_and_clean(e)


SAMPLED = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True,
                         logprobs=2)


def test_seeded_samples(engine, prompts_and_refs):
    """n-gram drafts: the plain sampler's tokens (each position's own noise) and logprobs; a
    draft model's: the rejection sampler's, the same on every run."""
    short, _, _ = prompts_and_refs
    plain = engine("plain").generate(short, SAMPLED)
    ngram = engine("ngram").generate(short, SAMPLED)
    assert [o.token_ids for o in ngram] == [o.token_ids for o in plain]
    for a, b in zip(ngram, plain):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys() and np.allclose(list(x.values()), list(y.values()),
                                                        atol=1e-4)
    draft = engine("draft-chunked-mixed")
    first, again = draft.generate(short, SAMPLED), draft.generate(short, SAMPLED)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert [o.token_ids for o in first] != [o.token_ids for o in plain]
    for e in (engine("plain"), engine("ngram"), draft):
        assert_idle_and_clean(e)


def test_requests_that_do_not_speculate_ride_along(engine, prompts_and_refs):
    """Penalties, a logit bias and ``speculate=False`` keep a request to one token per step (in
    the same steps as the verifying ones); n > 1 samples speculate each; every output is the
    engine's without speculation."""
    short, long, _ = prompts_and_refs
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_new_tokens=NEW, ignore_eos=True, logit_bias={7: 3.0}),
              SamplingParams(max_new_tokens=NEW, ignore_eos=True, speculate=False),
              SamplingParams(max_new_tokens=NEW, ignore_eos=True, n=2, temperature=0.7, seed=3),
              GREEDY]
    prompts = short[:4] + long[3:4]
    draft = engine("draft-chunked-mixed")
    before = draft.stats()["spec_verified_seqs"]
    ours = draft.generate(prompts, params)
    assert draft.stats()["spec_verified_seqs"] > before
    theirs = engine("plain").generate(prompts, params)
    assert [o.token_ids for o in ours[:3]] == [o.token_ids for o in theirs[:3]]
    assert [o.token_ids for o in ours[-1:]] == [o.token_ids for o in theirs[-1:]]
    assert len(ours) == 6 and all(len(o.token_ids) == NEW for o in ours)
    assert_idle_and_clean(draft)


def test_stops_lengths_logprobs_and_streams_inside_accepted_runs(llama_with_tokenizer,
                                                                 prompts_and_refs):
    """The target as its own draft accepts every draft: runs of k + 1 tokens per step. A stop
    token, a stop string or max_new_tokens ends the output inside a run exactly where decoding
    one token per step ends it; logprobs are HF's; a stream's deltas carry several tokens."""
    short, _, refs = prompts_and_refs
    e = Engine(llama_with_tokenizer, **{**TINY, "skip_tokenizer_init": False},
               speculative_method="draft", num_speculative_tokens=4)
    text = lambda ids: " ".join(f"w{t}" for t in ids)  # noqa: E731
    params = [SamplingParams(max_new_tokens=NEW, ignore_eos=True, stop_token_ids=[refs[0][6]]),
              SamplingParams(max_new_tokens=NEW, ignore_eos=True,
                             stop=[text(refs[1][3:5])]),
              SamplingParams(max_new_tokens=7, ignore_eos=True, logprobs=2)]
    outs = e.generate(short[:3], params)
    assert e.stats()["spec_acceptance_rate"] == 1.0
    first_stop = refs[0].index(refs[0][6])
    assert outs[0].token_ids == refs[0][:first_stop + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == refs[1][:5] and outs[1].text == " " + text(refs[1][:3]) + " "
    assert outs[1].finish_reason == "stop"
    assert outs[2].token_ids == refs[2][:7] and outs[2].finish_reason == "length"
    hf = hf_reference.load_hf(llama_with_tokenizer)
    rows = hf_reference.log_softmax_rows(hf, short[2] + refs[2][:7], len(short[2]))
    hf_reference.assert_logprobs_match(outs[2].logprobs, refs[2][:7], rows, 2)
    deltas = [o.new_token_ids for o in e.stream([short[3]], GREEDY)]
    assert sum(deltas, []) == refs[3] and max(map(len, deltas)) >= 5
    assert_idle_and_clean(e)


def test_abort_while_speculating(engine, prompts_and_refs):
    short, _, _ = prompts_and_refs
    e = engine("draft-chunked-mixed")
    ids = [e.add_request(p, GREEDY) for p in short[:3]]
    for _ in range(4):
        e.step()
    assert e.abort(ids[1])
    while e.has_unfinished():
        e.step()
    assert_idle_and_clean(e)


@pytest.mark.parametrize("fields,message", [
    (dict(speculative_method="ngram", num_speculative_tokens=0),
     "num_speculative_tokens must be an integer >= 1"),
    (dict(speculative_method="medusa"), "speculative_method must be None, 'ngram' or 'draft'"),
    (dict(speculative_draft_model="x"), "speculative_draft_model needs speculative_method='draft'"),
    (dict(speculative_method="ngram", speculative_ngram_min=3, speculative_ngram_max=2),
     "speculative_ngram_max must be >= speculative_ngram_min=3"),
    (dict(speculative_method="draft", simulate="h200"), "cannot be simulated"),
    (dict(speculative_method="draft", kv_cache_dtype="fp8_e4m3"),
     "kv_cache_dtype='fp8_e4m3' with speculative_method='draft' is not supported"),
])
def test_bad_configurations(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)


def test_draft_models_that_do_not_fit_are_refused(tiny_dir, draft_llama, tmp_path):
    with pytest.raises(ValueError, match="vocabulary of 263 tokens is not the target's 301"):
        Engine(tiny_dir["llama"], **TINY, speculative_method="draft",
               speculative_draft_model=str(tiny_dir["qwen2"]))
    short = tmp_path / "short"
    shutil.copytree(draft_llama, short)
    config = (short / "config.json").read_text()
    (short / "config.json").write_text(config.replace('"max_position_embeddings": 128',
                                                      '"max_position_embeddings": 64'))
    with pytest.raises(ValueError, match=r"max_position_embeddings=64\) is shorter than the "
                                         r"engine's context_length=128"):
        Engine(tiny_dir["llama"], **TINY, speculative_method="draft",
               speculative_draft_model=str(short))
    with pytest.raises(ValueError, match="speculative_draft_layers=3 exceeds the draft model's 2"):
        Engine(tiny_dir["llama"], **TINY, speculative_method="draft", speculative_draft_layers=3)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=8: .* context_length >= 10"):
        Engine(tiny_dir["llama"], **{**TINY, "context_length": 9}, speculative_method="ngram",
               num_speculative_tokens=8)


def homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Chi-square test that two samples of tokens come from one distribution: (statistic,
    critical value at p = 1e-4 by Wilson-Hilferty); tokens seen fewer than 10 times in both
    together share one cell."""
    tokens, counts = np.unique(np.concatenate([a, b]), return_counts=True)
    rare = set(tokens[counts < 10].tolist())
    cell = lambda x: np.array([-1 if t in rare else t for t in x])  # noqa: E731
    cells = np.unique(np.concatenate([cell(a), cell(b)]))
    table = np.array([[np.sum(cell(x) == c) for c in cells] for x in (a, b)], float)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    df = len(cells) - 1
    stat = float(((table - expected) ** 2 / expected).sum())
    return stat, df * (1 - 2 / (9 * df) + 3.72 * np.sqrt(2 / (9 * df))) ** 3


def test_draft_model_samples_have_the_targets_distribution(engine):
    """300 samples of 3 tokens after one prompt with the draft model (rejection sampling) and
    300 with the plain sampler (other seeds): per position, the token frequencies pass a
    chi-square test of homogeneity (fixed seeds: the same verdict on every run)."""
    def samples(e: Engine, first_seed: int) -> np.ndarray:
        params = [SamplingParams(max_new_tokens=3, temperature=3.0, top_k=8, seed=s, n=3,
                                 ignore_eos=True) for s in range(first_seed, first_seed + 100)]
        return np.array([o.token_ids for o in e.generate([[5, 17, 42]] * 100, params)])

    draft = engine("draft-chunked-mixed")
    before = draft.stats()
    ours = samples(draft, 0)
    stats = draft.stats()
    accepted = stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < stats["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    theirs = samples(engine("plain"), 1000)
    for position in range(3):
        stat, critical = homogeneity(ours[:, position], theirs[:, position])
        assert stat < critical, (position, stat, critical)
    assert len(np.unique(theirs[:, 0])) > 3  # a spread distribution: a test with power
    assert_idle_and_clean(draft)
